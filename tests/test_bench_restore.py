"""`bench/bench_restore.py`: its snapshot holds E / W entries per worker, and both loads it compares (the
C load and the per-entry loop) restore it to the same state, every entry on GPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from indexer.core import native as native_core
from indexer.snapshot import decode_snapshot

ROOT = Path(__file__).resolve().parent.parent

from bench import bench_restore as br  # noqa: E402


@pytest.mark.skipif(not native_core.available(), reason="accelerator not built")
def test_both_loads_restore_the_snapshot() -> None:
    data = br.snapshot(6_400, 50)  # 4 documents per worker: 50 workers need a 4-word residency table
    workers = decode_snapshot(data).models[0].workers
    assert len(workers) == 50 and all(len(evs[0].extra_keys) == 6_400 // 50 for _, _, evs in workers)
    prints = []
    for c_load in (True, False):
        _, _, ix = br.restore(data, c_load)
        prints.append(br.fingerprint(ix))
    assert prints[0] == prints[1]
    stats, nodes, width, _ = prints[0]
    assert all(s == {"gpu": 128, "host": 0, "disk": 0, "shared": 0} for s in stats.values())
    assert nodes < 6_400 and width == 4  # shared documents; slots 0..49 need 200 bits
