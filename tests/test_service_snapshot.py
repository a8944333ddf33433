"""Snapshots: the stores (file: atomic replace; Redis: a real server, generation counter), the
service round trip, and the real thing — `kvatlas indexer` killed with SIGKILL mid-stream and
restarted from its Redis snapshot ends in exactly the state of an indexer that never stopped."""
from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import redis

from support.net import RedisServer, free_port, wait_until
from indexer.snapshot import (
    FileSnapshotStore,
    RedisSnapshotStore,
    SnapshotError,
    decode_snapshot,
    make_snapshot_store,
)
from router_api.config import ServiceConfig
from support.fleet import BS, Fleet
from support.service import KVIndexerProcess, LiveIndexer, check_scores, dump_state, wait_applied


def test_file_store_replaces_atomically(tmp_path: Path) -> None:
    path = tmp_path / "snap" / "kvatlas.snapshot"
    store = make_snapshot_store(str(path))
    assert isinstance(store, FileSnapshotStore) and store.load() is None
    store.save(b"first")
    store.save(b"second")
    assert store.load() == b"second"
    assert os.listdir(path.parent) == ["kvatlas.snapshot"]  # no temp files left behind
    assert make_snapshot_store(f"file://{path}").load() == b"second"
    with pytest.raises(ValueError, match="unsupported snapshot target"):
        make_snapshot_store("s3://bucket/key")
    with pytest.raises(SnapshotError, match="corrupt"):
        decode_snapshot(b"\x93not a snapshot")
    blocked = FileSnapshotStore(str(tmp_path / "file-not-dir" / "x"))
    (tmp_path / "file-not-dir").write_text("a file where a directory should be")
    with pytest.raises(SnapshotError, match="cannot write"):
        blocked.save(b"x")


def test_redis_store_generation_and_failures(redis_server: RedisServer) -> None:
    store = make_snapshot_store(redis_server.url, key="t:snap")
    assert isinstance(store, RedisSnapshotStore)
    assert store.load() is None and store.generation() == 0
    store.save(b"one")
    store.save(b"two")
    assert store.load() == b"two" and store.generation() == 2
    store.close()
    dead = RedisSnapshotStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    with pytest.raises(SnapshotError, match="cannot write"):
        dead.save(b"x")
    with pytest.raises(SnapshotError, match="cannot read"):
        dead.load()


@pytest.mark.parametrize("shards", [(1, 1), (2, 1), (1, 2)], ids=["one", "two-to-one", "one-to-two"])
def test_service_snapshot_round_trip_to_file(tmp_path: Path, shards: tuple[int, int]) -> None:
    """(With ingest shards too: a snapshot is per worker, so it restores into any number of shards.)"""
    target = str(tmp_path / "kv.snap")
    cfg = ServiceConfig(port=free_port(), block_size=BS, snapshot_target=target, snapshot_interval_s=3600,
                        stats_ttl_s=0.0, ingest_shards=shards[0])
    a = LiveIndexer(cfg).start()
    fleet = Fleet(a.client, 3, seed=11)
    try:
        marks = fleet.run(40, random.Random(11))
        fleet.settle(marks)
        dump_a = a.client.get("/dump").json()
        workers_a = a.client.get("/workers").json()["workers"]
        a.stop()  # clean stop writes the final snapshot
        snap = decode_snapshot(Path(target).read_bytes())
        assert {w.reg.worker_id for w in snap.workers} == set(fleet.sims)
        assert {w.reg.worker_id: w.last_seq for w in snap.workers} == dump_a["watermarks"]

        b = LiveIndexer(ServiceConfig(port=free_port(), block_size=BS, snapshot_target=target,
                                      snapshot_interval_s=3600, stats_ttl_s=0.0, ingest_shards=shards[1])).start()
        try:
            assert b.service.restored_from == snap.generation
            dump_b = b.client.get("/dump").json()
            assert dump_state(dump_b) == dump_state(dump_a) and dump_b["watermarks"] == dump_a["watermarks"]
            assert len(dump_state(dump_a)) == 3 and all(dump_state(dump_a).values())
            workers_b = {w["worker_id"]: w for w in b.client.get("/workers").json()["workers"]}
            for w in workers_a:
                assert workers_b[w["worker_id"]]["blocks"] == w["blocks"]
                assert workers_b[w["worker_id"]]["endpoint"] == w["endpoint"]
            check_scores(b.client, fleet.sims, [q for s in fleet.sims.values() for q in s.sample_queries(5)])
        finally:
            b.stop()
    finally:
        fleet.close()


@pytest.mark.parametrize("shards", [1, 2])
def test_kill_and_restart_from_redis_mid_stream(redis_server: RedisServer, tmp_path: Path, shards: int) -> None:
    port = free_port()
    args = ("--block-size", str(BS), "--snapshot", redis_server.url, "--snapshot-key", f"kv:test{shards}",
            "--snapshot-interval", "0.2", "--stale-after", "60", "--replay-timeout", "2",
            "--ingest-shards", str(shards))
    proc = KVIndexerProcess(port, *args, log_path=tmp_path / "indexer-1.log")
    proc.wait_ready()
    rds = redis.Redis.from_url(redis_server.url)
    fleet = Fleet(proc.client, 4, seed=21)
    rng = random.Random(21)
    try:
        marks = fleet.run(60, rng)
        fleet.settle(marks)
        # Wait for a periodic snapshot (every 0.2 s when something changed) that holds this state.
        def snapshotted() -> bool:
            raw = rds.get(f"kv:test{shards}")
            snap = decode_snapshot(raw) if raw else None
            return snap is not None and all((w.last_seq or -1) >= marks[w.reg.worker_id] for w in snap.workers) \
                and len(snap.workers) == 4
        wait_until(snapshotted, timeout=10, interval=0.05)

        # Mid-stream: a publisher thread keeps sending while the indexer is SIGKILLed.
        sent = threading.Event()
        target = {wid: p.next_seq + 150 - 1 for wid, p in fleet.pubs.items()}

        def stream() -> None:
            order = [wid for wid in fleet.sims for _ in range(150)]
            random.Random(22).shuffle(order)
            for i, wid in enumerate(order):
                fleet.publish(wid, fleet.sims[wid].step())
                if i == 100:
                    sent.set()
            sent.set()

        t = threading.Thread(target=stream)
        t.start()
        sent.wait(10)
        wait_until(lambda: any(w["last_seq"] > marks[w["worker_id"]]
                               for w in proc.client.get("/workers").json()["workers"]), timeout=10, interval=0.01)
        proc.kill()
        t.join(30)
        for p in fleet.pubs.values():
            p.flush(10)
        snap = decode_snapshot(rds.get(f"kv:test{shards}"))
        assert {w.reg.worker_id for w in snap.workers} == set(fleet.sims)
        # The snapshot is behind the stream: the restart must replay, not just reload.
        assert any((w.last_seq or 0) < target[w.reg.worker_id] for w in snap.workers)

        proc2 = KVIndexerProcess(port, *args, log_path=tmp_path / "indexer-2.log")
        proc2.wait_ready()
        try:
            fleet.client = proc2.client
            wait_applied(proc2.client, target, timeout=30, pubs=fleet.pubs)
            rows = {w["worker_id"]: w for w in proc2.client.get("/workers").json()["workers"]}
            assert set(rows) == set(fleet.sims)
            assert all(r["resyncs"] == 0 and r["restarts"] == 0 for r in rows.values()), rows
            assert sum(r["replays"] for r in rows.values()) >= 1
            queries = [q for s in fleet.sims.values() for q in s.sample_queries(6)]
            fleet.check_reference(queries)
            check_scores(proc2.client, fleet.sims, queries)
            ref_stats = {wid: ref for (wid, _), ref in fleet.ref.worker_stats("default").items()}
            # Block counts in /workers may lag by the stats cache TTL (1 s by default).
            wait_until(lambda: {w["worker_id"]: w["blocks"] for w in proc2.client.get("/workers").json()["workers"]}
                       == ref_stats, timeout=60, interval=0.1)
            # Same state as never stopping, event for event.
            state = dump_state(proc2.client.get("/dump").json())
            for wid, sim in fleet.sims.items():
                assert state[(wid, 0)] == {h: b.tiers for h, b in sim.blocks.items() if b.tiers}
            assert proc2.terminate() == 0  # a clean stop still works and snapshots once more
        finally:
            if proc2.proc.poll() is None:
                proc2.kill()
        log = (tmp_path / "indexer-2.log").read_text()
        assert "event=snapshot_loaded" in log and "event=gap_replayed" in log
    finally:
        fleet.close()
        if proc.proc.poll() is None:
            proc.kill()
        rds.close()
    assert msgspec and httpx and time  # modules used for typing / helpers above
