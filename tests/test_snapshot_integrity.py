"""Snapshots carry a version and a checksum: a single flipped bit anywhere in the file is refused
like a truncated or garbage one, and the service refuses to start from it (issue 37, finding 3)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from indexer.snapshot import SNAPSHOT_VERSION, FileSnapshotStore, ModelSnapshot, Snapshot, SnapshotError
from indexer.snapshot import WorkerSnapshot, decode_snapshot, encode_snapshot
from router_api.config import ServiceConfig
from router_api.service import IndexerService
from schemas.api import RegisterWorker
from schemas.events import BlockStored
from support.net import free_port

BS = 4


def _small_snapshot() -> bytes:
    reg = RegisterWorker("w0", "tcp://127.0.0.1:5557", model="m", block_size=BS)
    stored = [BlockStored([1000 + i], None if i == 0 else 999 + i, [i] * BS, BS, None, "GPU") for i in range(3)]
    return encode_snapshot(Snapshot(SNAPSHOT_VERSION, 3, 1.5, [WorkerSnapshot(reg, 41, [0])],
                                    [ModelSnapshot("m", BS, [("w0", 0, stored)])]))


def test_every_single_bit_flip_is_refused() -> None:
    data = _small_snapshot()
    assert decode_snapshot(data).workers[0].last_seq == 41
    loaded = []
    for bit in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            decode_snapshot(bytes(flipped))
        except SnapshotError:
            continue
        loaded.append(bit)
    assert loaded == [], f"{len(loaded)} of {len(data) * 8} single-bit flips loaded"


def test_truncated_padded_and_other_versions_are_refused() -> None:
    data = _small_snapshot()
    for bad in (data[:-1], data + b"\x00", data[:10], b"", data.replace(b"KVATLAS-SNAPSHOT", b"KVATLAS-SNAPSHOX")):
        with pytest.raises(SnapshotError):
            decode_snapshot(bad)


def test_service_refuses_a_flipped_snapshot_and_keeps_it(tmp_path: Path) -> None:
    target = tmp_path / "kv.snap"
    data = bytearray(_small_snapshot())
    data[len(data) - 7] ^= 0x10  # deep in the payload: an event's field
    FileSnapshotStore(str(target)).save(bytes(data))
    svc = IndexerService(ServiceConfig(port=free_port(), block_size=BS, snapshot_target=str(target)))
    with pytest.raises(SnapshotError, match="Not starting"):
        svc.start()
    svc.stop()
    assert target.read_bytes() == bytes(data)
    assert svc.metrics.snapshots.get("load_failed") >= 1


def test_round_trip_keeps_the_snapshot() -> None:
    snap = decode_snapshot(_small_snapshot())
    assert snap.version == SNAPSHOT_VERSION and snap.generation == 3
    assert [len(ev) for _w, _r, ev in snap.models[0].workers] == [3]
    assert time.time() > snap.created_ts
