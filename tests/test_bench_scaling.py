"""`bench/bench_scaling.py`: the workload holds what it says (each worker E / W entries, each document on
~SHARE workers), and a point's snapshot restores to the same resident entries, one index or sharded."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

from bench import bench_scaling as bs  # noqa: E402


def test_plan_spreads_documents_over_workers() -> None:
    docs, per_worker, held = bs.plan(64_000, 20)
    assert per_worker == 64_000 // (20 * bs.DOC_BLOCKS) and held.shape == (20, per_worker)
    assert docs == 20 * per_worker // bs.SHARE
    for row in held:
        assert len(set(row.tolist())) == per_worker  # a worker never holds a document twice
    assert held.min() >= 0 and held.max() < docs


@pytest.mark.parametrize("shards", [1, 2])
def test_point_restores_what_it_ingested(shards: int) -> None:
    r = bs.child_kvatlas(12_800, 10, shards)
    assert r["entries"] == 10 * (12_800 // (10 * bs.DOC_BLOCKS)) * bs.DOC_BLOCKS
    assert r["restored_equal"] and r["native"] in (True, False)
    assert r["nodes"] < r["entries"]  # documents are shared: fewer nodes than (worker, block) entries
    assert r["snapshot_bytes"] > 0 and r["score_p50_us"] > 0


def test_http_point_serves_both_answers() -> None:
    """`--http`: a served model's holders' answer is smaller than its full one, the same size with idle
    workers registered more."""
    a = bs.http_point(12_800, 40, sys.executable)
    b = bs.http_point(12_800, 40, sys.executable, idle=30)
    assert a["entries"] == b["entries"] == 12_800
    assert a["holders_bytes_p50"] == b["holders_bytes_p50"] < a["full_bytes_p50"] < b["full_bytes_p50"]
    assert a["holders_p50_ms"] > 0 and a["full_p50_ms"] > 0
