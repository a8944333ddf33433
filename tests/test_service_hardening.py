"""The holes a hostile probe found in the service, one class per test (docs/service.md,
"Reliability"): snapshot restore never loses data silently; replays never stall other workers;
registration never says yes when it failed; one message cap at the socket; HTTP edge cases."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from support.net import free_port, wait_until
from indexer.index import KVIndex
from indexer.snapshot import (
    SNAPSHOT_VERSION,
    FileSnapshotStore,
    ModelSnapshot,
    RedisSnapshotStore,
    Snapshot,
    SnapshotError,
    WorkerSnapshot,
    encode_snapshot,
)
from indexer.deliveries import Batch, Gap
from indexer.subscriber import Subscriber
from producer.publisher import ZmqEventPublisher
from router_api.http_log import RateLimitedLog
from cli.indexer import SafeTextFormatter, add_arguments, build_config
from router_api.registry import DuplicateWorker, InvalidRegistration, Registry, RegistryFull
from router_api.config import ServiceConfig
from router_api.service import IndexerService
from schemas.api import RegisterWorker
from schemas.events import BlockStored
from schemas.frames import seq_bytes
from support.service import LiveIndexer
from support.hostile import HostilePublisher

BS = 4


def _stored(i: int) -> BlockStored:
    return BlockStored([1000 + i], None, [i] * BS, BS, None, "GPU")


# --- 1. snapshot restore ------------------------------------------------------------------------

class _BadModelIndex(KVIndex):
    """A KVIndex whose dump for model "bad" cannot be loaded (as with a block-size conflict)."""

    def load_dump(self, model: str, block_size: int, dump: Any) -> int:
        n = super().load_dump(model, block_size, dump)  # part of it gets in, then it fails
        if model == "bad":
            raise ValueError("cannot load this model's dump")
        return n


def _snapshot(path: Path) -> None:
    reg_ok = RegisterWorker("ok", f"tcp://127.0.0.1:{free_port()}", model="good", block_size=BS)
    reg_bad = RegisterWorker("lost", f"tcp://127.0.0.1:{free_port()}", model="bad", block_size=BS)
    snap = Snapshot(SNAPSHOT_VERSION, 7, time.time(),
                    [WorkerSnapshot(reg_ok, 41, [0]), WorkerSnapshot(reg_bad, 41, [0])],
                    [ModelSnapshot("good", BS, [("ok", 0, [_stored(1)])]),
                     ModelSnapshot("bad", BS, [("lost", 0, [_stored(2)])])])
    FileSnapshotStore(str(path)).save(encode_snapshot(snap))


def test_watermark_restored_only_with_its_state(tmp_path: Path) -> None:
    target = tmp_path / "kv.snap"
    _snapshot(target)
    svc = IndexerService(ServiceConfig(port=free_port(), block_size=BS, snapshot_target=str(target)),
                         index=_BadModelIndex())
    svc.start()
    try:
        ok, lost = svc.registry.get("ok"), svc.registry.get("lost")
        assert ok is not None and ok.last_seq == 41  # its state came back: replay from 42
        assert lost is not None and lost.last_seq is None  # its state did not: replay from 0
        assert all(not events for _w, _r, events in svc.index.dump("bad"))  # nothing half-loaded remains
        assert svc.metrics.snapshots.get("worker_not_restored") == 1
    finally:
        svc.stop(final_snapshot=False)


def test_unreadable_snapshot_is_never_overwritten(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.snap"
    corrupt.write_bytes(b"\x93not a snapshot")
    svc = IndexerService(ServiceConfig(port=free_port(), block_size=BS, snapshot_target=str(corrupt)))
    with pytest.raises(SnapshotError, match="Not starting"):
        svc.start()
    svc.stop()  # a stop after a refused start writes nothing
    assert corrupt.read_bytes() == b"\x93not a snapshot"

    dead = RedisSnapshotStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)
    svc = IndexerService(ServiceConfig(port=free_port(), block_size=BS, snapshot_load_timeout_s=0.5),
                         snapshot_store=dead)
    t0 = time.monotonic()
    with pytest.raises(SnapshotError, match="still unreadable"):
        svc.start()
    assert time.monotonic() - t0 >= 0.5  # retried first
    assert svc.metrics.snapshots.get("load_failed") >= 2


# --- 3. replays: deadline, caps, never blocking other workers -----------------------------------

@pytest.mark.parametrize("mode", ["trickle", "flood"])
def test_hostile_replay_never_stalls_healthy_workers(mode: str) -> None:
    hostile = HostilePublisher(mode)
    healthy = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    # Trickle: the junk keeps the replay alive until its deadline, long enough (6 s) that the
    # healthy batches below are all served while it runs, with a wide margin on a loaded machine.
    deadline = 6.0 if mode == "trickle" else 2.0
    sub = Subscriber(replay_timeout=1.0, replay_deadline=deadline, replay_max_bytes=8 * 1024 * 1024)
    try:
        sub.add("bad", hostile.endpoint, hostile.replay_endpoint)
        sub.add("good", healthy.endpoint, healthy.replay_endpoint)
        got: list[Any] = []

        def pump(until: Any, timeout: float = 10.0) -> None:
            deadline = time.monotonic() + timeout
            while not until():
                assert time.monotonic() < deadline, "timed out"
                hostile.send(0)
                healthy.heartbeat()
                got.extend(sub.poll(10))

        pump(lambda: {d.worker_id for d in got if isinstance(d, Batch)} == {"bad", "good"})
        hostile.send(500)  # a gap 1..499: the replay endpoint answers with junk
        wait_until(lambda: got.extend(sub.poll(10)) or sub.replaying() == ["bad"], timeout=30)
        # While the hostile replay runs, the healthy worker's batches keep flowing: each one is
        # delivered before the hostile replay ends (an ordering, not a wall-clock bound).
        for _ in range(10):
            healthy.publish([_stored(0)])
            seq = healthy.next_seq - 1

            def delivered(seq: int = seq) -> bool:
                got.extend(sub.poll(10))
                return any(isinstance(d, Batch) and d.worker_id == "good" and d.seq >= seq for d in got)
            wait_until(delivered, timeout=10.0, interval=0.0)
            if mode == "trickle":  # still replaying: the healthy one was not waiting on it
                assert sub.replaying() == ["bad"]
                assert not any(isinstance(d, Gap) and d.worker_id == "bad" for d in got)
        pump(lambda: any(isinstance(d, Gap) and d.worker_id == "bad" for d in got), timeout=deadline + 10)
        gap = next(d for d in got if isinstance(d, Gap) and d.worker_id == "bad")
        assert (gap.first, gap.last, gap.recovered) == (1, 499, False)
        assert sub.stats.replay_capped == 1  # deadline (trickle) or byte cap (flood), not silence
    finally:
        sub.close()
        healthy.close()
        hostile.close()


def test_message_cap_is_set_on_every_socket() -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    ep = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    sub = Subscriber(max_msg_bytes=4096, reconnect_after=0.5)
    try:
        sub.add("w", ep)
        assert sub._sources["w"].sock.getsockopt(zmq.MAXMSGSIZE) == 4096
        small = msgspec.msgpack.encode([0.0, [], 0])
        got: list[Any] = []

        def delivered(seq: int) -> bool:
            got.extend(sub.poll(10))
            return any(isinstance(d, Batch) and d.seq == seq for d in got)

        seq = 0
        while not delivered(seq):  # PUB/SUB join
            seq += 1
            pub.send_multipart([b"", seq_bytes(seq), small])
        big = seq + 1
        pub.send_multipart([b"", seq_bytes(big), b"x" * 8192])  # refused by ZeroMQ, before any copy
        nxt = big + 1

        def after() -> bool:
            nonlocal nxt
            pub.send_multipart([b"", seq_bytes(nxt), small])
            nxt += 1
            return delivered(nxt - 1) or any(isinstance(d, Batch) and d.seq > big for d in got)
        wait_until(after, timeout=10, interval=0.01)
        assert not any(isinstance(d, Batch) and d.seq == big for d in got)
        assert sub.stats.reconnects >= 1  # ZeroMQ ended the session; the silence check restored it
    finally:
        sub.close()
        pub.close(0)
        ctx.term()


# --- 5. registration ----------------------------------------------------------------------------

def test_registration_normalises_caps_and_checks_ids(tmp_path: Path) -> None:
    r = Registry(max_workers=2)
    p = free_port()
    r.add(RegisterWorker("a", f"tcp://127.0.0.1:{p}"), now=0)
    with pytest.raises(DuplicateWorker, match="already registered as 'a'"):
        r.add(RegisterWorker("b", f"tcp://localhost:{p}"), now=0)
    with pytest.raises(DuplicateWorker):
        r.add(RegisterWorker("b", f"tcp://127.1:{p}"), now=0)
    with pytest.raises(InvalidRegistration, match="wildcard"):
        r.add(RegisterWorker("b", f"tcp://*:{p}"), now=0)
    with pytest.raises(InvalidRegistration, match="does not resolve"):
        r.add(RegisterWorker("b", "tcp://no-such-host.invalid:5"), now=0)
    for bad in ("a/b", "a\nb", "a b", "x%2f"):
        with pytest.raises(InvalidRegistration, match="invalid worker_id"):
            r.add(RegisterWorker(bad, f"tcp://127.0.0.1:{free_port()}"), now=0)
    r.add(RegisterWorker("ipc1", f"ipc://{tmp_path}/pub"), now=0)
    with pytest.raises(RegistryFull):
        r.add(RegisterWorker("c", f"tcp://127.0.0.1:{free_port()}"), now=0)
    r.remove("a")
    with pytest.raises(DuplicateWorker):
        r.add(RegisterWorker("ipc2", f"ipc://{tmp_path}/./x/../pub"), now=0)


def test_failed_subscription_is_never_a_201() -> None:
    def factory() -> Subscriber:
        ctx = zmq.Context()
        ctx.set(zmq.MAX_SOCKETS, 1)  # the second SUB socket cannot be opened
        return Subscriber(ctx)

    cfg = ServiceConfig(port=free_port(), block_size=BS, max_workers=3, stats_ttl_s=0.0)
    with LiveIndexer(cfg, subscriber_factory=factory) as li:
        ok = li.client.post("/workers", json={"worker_id": "w0", "endpoint": f"tcp://127.0.0.1:{free_port()}", "block_size": BS})
        assert ok.status_code == 201, ok.text
        r = li.client.post("/workers", json={"worker_id": "w1", "endpoint": f"tcp://127.0.0.1:{free_port()}", "block_size": BS})
        assert r.status_code == 503 and "cannot subscribe" in r.json()["error"], r.text
        assert [w["worker_id"] for w in li.client.get("/workers").json()["workers"]] == ["w0"]
        for bad in ({"worker_id": "w/1", "endpoint": f"tcp://127.0.0.1:{free_port()}", "block_size": BS},
                    {"worker_id": "w2", "endpoint": f"tcp://*:{free_port()}"},
                    {"worker_id": "w3", "endpoint": f"tcp://localhost:{ok.json()['endpoint'].rsplit(':', 1)[1]}"}):
            assert li.client.post("/workers", json=bad).status_code in (400, 409)
    cfg = ServiceConfig(port=free_port(), block_size=BS, max_workers=1, stats_ttl_s=0.0)
    with LiveIndexer(cfg) as li:
        assert li.client.post("/workers", json={"worker_id": "a", "endpoint": f"tcp://127.0.0.1:{free_port()}", "block_size": BS}
                              ).status_code == 201
        full = li.client.post("/workers", json={"worker_id": "b", "endpoint": f"tcp://127.0.0.1:{free_port()}", "block_size": BS})
        assert full.status_code == 503 and "limit" in full.json()["error"]


# --- 6/7. frame drops in /metrics, HTTP edge cases -------------------------------------------------

def _metric(li: LiveIndexer, needle: str) -> float:
    for line in li.client.get("/metrics").text.splitlines():
        if line.startswith(needle):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_frame_drops_reach_metrics() -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    ep = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        with LiveIndexer(ServiceConfig(port=free_port(), block_size=BS, stats_ttl_s=0.0)) as li:
            assert li.client.post("/workers", json={"worker_id": "w", "endpoint": ep, "block_size": BS}).status_code == 201

            def dropped() -> bool:
                pub.send_multipart([b"", b"only two"])
                pub.send_multipart([b"", b"1234", b"payload"])
                return (_metric(li, 'kvatlas_drops_total{reason="frame_frame_count"}') > 0
                        and _metric(li, 'kvatlas_drops_total{reason="frame_seq_frame_size"}') > 0)
            wait_until(dropped, timeout=10, interval=0.02)
    finally:
        pub.close(0)
        ctx.term()


@pytest.mark.parametrize("native", [True, False])
def test_deep_nesting_is_400_and_logged_once(native: bool, caplog: pytest.LogCaptureFixture) -> None:
    import httpx

    from router_api.app import create_app

    svc = IndexerService(ServiceConfig(port=free_port(), block_size=BS))
    app = create_app(svc, native_bodies=native)
    transport = httpx.ASGITransport(app=app)
    deep_json = b'{"token_ids":' + b"[" * 5000 + b"]" * 5000 + b"}"
    deep_mp = b"\x81\xa9token_ids" + b"\x91" * 5000 + b"\x90"
    unknown_deep = b'{"token_ids":[1],"x":' + b"[" * 5000 + b"]" * 5000 + b"}"

    async def run() -> list[int]:
        codes = []
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            for _ in range(10):
                for path in ("/score", "/query"):
                    codes.append((await c.post(path, content=deep_json)).status_code)
                    codes.append((await c.post(path, content=unknown_deep)).status_code)
                    codes.append((await c.post(path, content=deep_mp,
                                               headers={"content-type": "application/msgpack"})).status_code)
            codes.append((await c.post("/workers", content=b'{"worker_id":' + b"[" * 5000)).status_code)
        return codes

    import asyncio

    with caplog.at_level(logging.INFO):
        codes = asyncio.run(run())
    assert set(codes) <= {400, 422} and codes.count(400) >= 20, codes
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "too_deep" in lines[0].getMessage()
    assert not any(r.exc_info for r in caplog.records)


def test_rate_limited_log_counts_what_it_suppressed(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    lim = RateLimitedLog(10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING):
        assert lim.warning("k", "x=%d", 1) and not lim.warning("k", "x=%d", 2)
        now[0] = 11.0
        assert lim.warning("k", "x=%d", 3)
    assert [r.getMessage() for r in caplog.records] == ["x=1 suppressed_since_last=0", "x=3 suppressed_since_last=1"]


def test_bearer_scheme_case_insensitive_and_token_from_file(tmp_path: Path) -> None:
    cfg = ServiceConfig(port=free_port(), block_size=BS, auth_token="s3cret")
    with LiveIndexer(cfg) as li:
        import httpx

        with httpx.Client(base_url=li.url) as anon:
            for scheme in ("Bearer", "bearer", "BEARER"):
                r = anon.get("/workers", headers={"Authorization": f"{scheme} s3cret"})
                assert r.status_code == 200, scheme
            assert anon.get("/workers", headers={"Authorization": "Basic s3cret"}).status_code == 401
            assert anon.get("/workers", headers={"Authorization": "bearer S3CRET"}).status_code == 401
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    tok = tmp_path / "token"
    tok.write_text("from-file\n")
    assert build_config(p.parse_args(["--auth-token-file", str(tok)])).auth_token == "from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        build_config(p.parse_args(["--auth-token-file", str(tmp_path / "empty")]))


def test_text_logs_escape_control_characters() -> None:
    rec = logging.LogRecord("kvatlas", logging.WARNING, __file__, 1, "event=x worker=%s", ("a\nFORGED b",), None)
    line = SafeTextFormatter("%(levelname)s %(message)s").format(rec)
    assert "\n" not in line and "a\\nFORGED b" in line


@pytest.mark.parametrize("shards", [1, 2])
def test_health_answers_while_an_ingest_pipeline_holds_the_index_lock(shards: int) -> None:
    """/health never waits for the index lock: a hostile publisher's long chunk under it used to stall
    /health (and the event loop with it) for as long as the chunk ran (issue 24's soaks)."""
    svc = IndexerService(ServiceConfig(port=free_port(), block_size=BS, ingest_shards=shards))
    svc.start()
    try:
        svc.register(RegisterWorker(worker_id="w0", endpoint="tcp://127.0.0.1:20998", block_size=BS))
        got: list[Any] = []
        answered = threading.Event()
        with svc.lock:  # what an ingest pipeline holds while it applies a chunk
            t = threading.Thread(target=lambda: (got.append(svc.health()), answered.set()), daemon=True)
            t.start()
            assert answered.wait(30), "/health waited for the index lock"
        assert got[0].workers == 1 and got[0].models == {"default": BS}
    finally:
        svc.stop(final_snapshot=False)
