"""`kvatlas indexer --nats URL` replicas (real subprocesses, real uvicorn) against a real
`nats-server -js`: fed through JetStream by kvatlas publishers and by `kvatlas relay` in front of a
ZeroMQ publisher, they agree with each other and with the reference model; registrations made on
one replica reach the other; a replica killed and restarted from its snapshot file catches up
exactly; with the stream trimmed meanwhile, the snapshot + resync path is exact."""
from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.net import REPO_ROOT, free_port, wait_until
from support.jetstream import subject_last_seq
from transport.jetstream_publisher import JetStreamEventPublisher
from producer.publisher import ZmqEventPublisher
from schemas.events import AllBlocksCleared
from schemas.jetstream import DEFAULT_STREAM, event_subject, jetstream_endpoint, parse_headers
from transport.natsio import NatsThread
from support.nats import NatsServer
from support.service import KVIndexerProcess, WorkerSim, check_scores, make_prompts, snapshot_marks
from router_api.procs import spawn

BS = 4
MODEL = "default"


def _replica(url: str, tmp: Path, name: str, *extra: str) -> KVIndexerProcess:
    r = KVIndexerProcess(free_port(), "--nats", url, "--block-size", str(BS), *extra, log_path=tmp / f"{name}.log")
    r.wait_ready()
    return r


def _register(r: KVIndexerProcess, wid: str) -> None:
    resp = r.client.post("/workers", json={"worker_id": wid, "endpoint": jetstream_endpoint(MODEL, wid),
                                           "block_size": BS})
    assert resp.status_code == 201, resp.text


def _rows(r: KVIndexerProcess) -> dict[str, dict]:
    return {w["worker_id"]: w for w in r.client.get("/workers").json()["workers"]}


def _wait_applied(replicas: list[KVIndexerProcess], marks: dict[str, int], timeout: float = 30.0) -> None:
    """Every replica's last_seq (the stream seq applied) reached each worker's mark."""
    def done() -> bool:
        for r in replicas:
            rows = _rows(r)
            if any((rows.get(w, {}).get("last_seq") or 0) < m for w, m in marks.items()):
                return False
        return True
    wait_until(done, timeout=timeout, interval=0.05)


def _drive(pubs: dict, sims: dict[str, WorkerSim], steps: int) -> None:
    for _ in range(steps):
        for wid, sim in sims.items():
            pubs[wid].publish(sim.step())
    for p in pubs.values():
        assert p.flush(10.0)


def _relayed_mark(nt: NatsThread, wid: str, engine: ZmqEventPublisher) -> int:
    """Heartbeat the engine until the relay stored its last batch; the stream seq of that message."""
    subject = event_subject(MODEL, wid)
    target = engine.next_seq - 1

    def stored() -> int | None:
        try:
            msg = nt.call(lambda: nt.js.get_last_msg(DEFAULT_STREAM, subject))
        except Exception:  # nothing relayed yet
            msg = None
        hdrs = None if msg is None else parse_headers(msg.headers)
        if hdrs is None or isinstance(hdrs, str) or hdrs.seq < target:
            engine.heartbeat()  # a late subscriber learns of missed batches from the next one
            return None
        return int(msg.seq)
    return int(wait_until(stored, timeout=30.0, interval=0.05))  # type: ignore[arg-type]


def test_two_replicas_agree_with_the_reference_and_share_registrations(nats: NatsServer, tmp_path: Path) -> None:
    a = _replica(nats.url, tmp_path, "a")
    b = _replica(nats.url, tmp_path, "b")
    sims = {wid: WorkerSim(i, BS, make_prompts(20 + i, BS)) for i, wid in enumerate(["j0", "j1", "z0"])}
    pubs: dict = {w: JetStreamEventPublisher(nats.url, model=MODEL, worker_id=w) for w in ("j0", "j1")}
    engine = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    pubs["z0"] = engine
    relay = spawn(
        [sys.executable, "-m", "cli.main", "relay", "--nats", nats.url, "--worker",
         f"z0={engine.endpoint},replay={engine.replay_endpoint},model={MODEL},block_size={BS}"],
        cwd=REPO_ROOT, stdout=open(tmp_path / "relay.log", "ab"), stderr=subprocess.STDOUT)
    nt = NatsThread(nats.url)
    try:
        _register(a, "j0")  # on A only ...
        _register(b, "j1")  # ... on B only; the relay registers z0 itself
        wait_until(lambda: set(_rows(a)) == set(_rows(b)) == set(sims), timeout=30.0, interval=0.05)
        _drive(pubs, sims, 40)
        marks = {w: subject_last_seq(pubs[w]) for w in ("j0", "j1")}
        marks["z0"] = _relayed_mark(nt, "z0", engine)
        _wait_applied([a, b], marks)
        queries = [q for s in sims.values() for q in s.sample_queries(12)]
        assert check_scores(a.client, sims, queries) == len(queries)
        assert check_scores(b.client, sims, queries) == len(queries)
        for q in queries[:10]:  # identical answers, down to the stream position of each worker
            assert a.client.post("/score", json={"token_ids": q}).json() == \
                b.client.post("/score", json={"token_ids": q}).json()
        rows = _rows(b)
        assert all(rows[w]["resyncs"] == 0 and rows[w]["gaps"] == 0 for w in sims), rows
        metrics = b.client.get("/metrics").text
        for line in ('kvatlas_jetstream_consumer_lag_messages{worker="j0"}', 'kvatlas_jetstream_stream{field="bytes"}',
                     'kvatlas_jetstream_messages_total{outcome="duplicates"}', 'kvatlas_shared_registry_applied_total'):
            assert line in metrics, line
        # A registration removed on B disappears from A too.
        resp = b.client.delete("/workers/j0")
        assert resp.status_code == 200, resp.text
        wait_until(lambda: "j0" not in _rows(a), timeout=20.0, interval=0.05)
        # A malformed JetStream endpoint is refused with a reason, and never reaches the bucket.
        bad = a.client.post("/workers", json={"worker_id": "x", "endpoint": "jetstream:", "block_size": BS})
        assert bad.status_code == 400 and "jetstream:" in bad.text, bad.text
        assert "x" not in _rows(b)
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(20)
        nt.close()
        for r in (a, b):
            r.terminate()
        for p in pubs.values():
            p.close()




def _wait_snapshot(path: Path, marks: dict[str, int]) -> None:
    wait_until(lambda: all(snapshot_marks(path).get(w, -1) >= m for w, m in marks.items()),
               timeout=20.0, interval=0.05)


def test_killed_replica_catches_up_from_the_stream_and_resyncs_past_a_trimmed_one(
        nats: NatsServer, tmp_path: Path) -> None:
    snap = tmp_path / "replica.snapshot"
    args = ("--snapshot", str(snap), "--snapshot-interval", "0.2")
    sims = {wid: WorkerSim(i, BS, make_prompts(40 + i, BS)) for i, wid in enumerate(["j0", "j1"])}
    pubs = {w: JetStreamEventPublisher(nats.url, model=MODEL, worker_id=w) for w in sims}
    r = _replica(nats.url, tmp_path, "r1", *args)
    queries = lambda: [q for s in sims.values() for q in s.sample_queries(12)]  # noqa: E731
    try:
        for w in sims:
            _register(r, w)
        _drive(pubs, sims, 30)
        marks = {w: subject_last_seq(p) for w, p in pubs.items()}
        _wait_applied([r], marks)
        _wait_snapshot(snap, marks)
        r.kill()  # no final snapshot
        _drive(pubs, sims, 30)  # while it is down: only the stream has these
        r = _replica(nats.url, tmp_path, "r2", *args)
        marks = {w: subject_last_seq(p) for w, p in pubs.items()}
        _wait_applied([r], marks)
        check_scores(r.client, sims, queries())
        rows = _rows(r)
        assert all(rows[w]["resyncs"] == 0 and rows[w]["gaps"] == 0 for w in sims), rows

        # Down again, and retention removes what it missed: the snapshot is too old for the stream.
        _wait_snapshot(snap, marks)
        r.kill()
        _drive(pubs, sims, 20)
        nt = pubs["j0"]._nats
        keep_from = min(subject_last_seq(p) for p in pubs.values()) - 2
        nt.call(lambda: nt.js.purge_stream(DEFAULT_STREAM, seq=keep_from))
        r = _replica(nats.url, tmp_path, "r3", *args)
        answered: set[str] = set()

        def resynced() -> bool:  # the producers answer the snapshot request in-stream
            for w, p in pubs.items():
                if w not in answered and p.snapshot_requested():
                    sims[w].clear()
                    p.publish([AllBlocksCleared()])
                    answered.add(w)
            return answered == set(sims)
        wait_until(resynced, timeout=30.0, interval=0.05)
        _drive(pubs, sims, 10)
        marks = {w: subject_last_seq(p) for w, p in pubs.items()}
        _wait_applied([r], marks)
        check_scores(r.client, sims, queries())
        rows = _rows(r)
        assert all(rows[w]["resyncs"] >= 1 for w in sims), rows
    finally:
        if r.proc.poll() is None:
            r.terminate()
        for p in pubs.values():
            p.close()


def test_indexer_refuses_an_unreachable_nats(tmp_path: Path) -> None:
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "cli.main", "indexer", "--port", "0", "--nats",
                          f"nats://127.0.0.1:{port}"], cwd=REPO_ROOT, capture_output=True, timeout=60)
    assert out.returncode == 2 and f"nats://127.0.0.1:{port}".encode() in out.stderr


def test_pending_routes_reach_every_replica(nats: NatsServer, tmp_path: Path) -> None:
    """A route reported to one `--nats` replica shows as pending_blocks on the other; released on the
    other, it is gone from both (router_api/route_plane.py)."""
    a = _replica(nats.url, tmp_path, "a")
    b = _replica(nats.url, tmp_path, "b")
    try:
        _register(a, "w0")
        wait_until(lambda: "w0" in _rows(b), timeout=20)
        toks = list(range(1, 3 * BS + 2))

        def row(r: KVIndexerProcess) -> dict:
            rows = r.client.post("/score", json={"token_ids": toks}).json()["workers"]
            return next(w for w in rows if w["worker_id"] == "w0")

        def pending(r: KVIndexerProcess) -> int:
            return row(r).get("pending_blocks", 0)

        def load(r: KVIndexerProcess) -> tuple[int, int]:
            w = row(r)
            return w.get("pending_requests", 0), w.get("pending_prefill_tokens", 0)

        got = a.client.post("/routes", json={"request_id": "q1", "worker_id": "w0", "token_ids": toks})
        assert got.status_code == 200 and got.json()["blocks"] == 3, got.text
        got = a.client.post("/routes", json={"request_id": "q2", "worker_id": "w0", "token_ids": toks + [9] * BS,
                                             "busy_until": 123.5})
        assert got.status_code == 200 and got.json()["pending_blocks"] == 3, got.text
        wait_until(lambda: load(b) == (2, len(toks) + (len(toks) + BS - 3 * BS)), timeout=20)
        assert pending(b) == 3 and pending(a) == 3
        assert load(a) == load(b)  # both replicas see the same in-flight load on w0
        assert row(a)["busy_until"] == row(b)["busy_until"] == 123.5
        assert b.client.delete("/routes/q2").json() == {"released": 4}
        wait_until(lambda: load(a) == (1, len(toks)), timeout=20)
        assert b.client.delete("/routes/q1").json() == {"released": 3}
        wait_until(lambda: pending(a) == 0, timeout=20)
        assert pending(b) == 0
        assert 'kvatlas_route_fanout_total{direction="in",outcome="add"} 2' in b.client.get("/metrics").text
    finally:
        a.terminate()
        b.terminate()


def test_admissions_reach_every_replica(nats: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Causal forwarding across `--nats` replicas: a route reported with `admits` to replica a is one
    that replica b's reports depend on (`after`); a router waiting on b is released by the admission
    reported to a (router_api/route_plane.py)."""
    import hashlib
    import hmac
    import threading

    from router_api.routes import route_handle

    monkeypatch.setenv("KVATLAS_ROUTE_SECRET", "s3cret")  # shared: both replicas name a route alike
    key = hmac.new(b"s3cret", b"kvatlas route handles", hashlib.sha256).digest()
    h = {rid: route_handle(key, MODEL, rid) for rid in ("q1", "q2")}  # what `after` names: never the ids
    # the admissions below, not their deadline, end the waits (a loaded machine takes its time)
    a = _replica(nats.url, tmp_path, "a", "--route-admit-timeout", "60")
    b = _replica(nats.url, tmp_path, "b", "--route-admit-timeout", "60")
    try:
        _register(a, "w0")
        wait_until(lambda: "w0" in _rows(b), timeout=20)
        toks = list(range(1, 3 * BS + 2))
        got = a.client.post("/routes", json={"request_id": "q1", "worker_id": "w0", "token_ids": toks,
                                             "admits": True})
        assert got.status_code == 200 and got.json()["after"] == [], got.text
        wait_until(lambda: b.client.post("/routes", json={
            "request_id": "q2", "worker_id": "w0", "token_ids": toks + [9] * BS, "admits": True}).json()["after"]
            == [h["q1"]], timeout=20)
        waited: list[dict] = []
        waiter = threading.Thread(target=lambda: waited.append(b.client.post(
            "/routes/wait", json={"request_ids": [h["q1"]], "timeout_s": 30}, timeout=60).json()))
        waiter.start()
        wait_until(lambda: b.client.get("/stats").json()["pending"]["admission"]["waiting"] == 1, timeout=20)
        assert a.client.post("/routes/admitted", json={"request_id": "q1"}).json() == {"admitted": True}
        waiter.join(60)
        assert waited and waited[0]["waiting"] == [], waited
        # both replicas agree: q1 no longer holds anyone back, q2 (reported to b) still does
        for r in (a, b):
            wait_until(lambda: r.client.post("/routes", json={
                "request_id": "q3", "worker_id": "w0", "token_ids": toks + [9] * BS + [8] * BS,
                "admits": True}).json()["after"] == [h["q2"]], timeout=20)
            r.client.delete("/routes/q3")
        assert 'kvatlas_route_fanout_total{direction="in",outcome="admit"} 1' in b.client.get("/metrics").text
    finally:
        a.terminate()
        b.terminate()
