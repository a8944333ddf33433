"""Hostile parties on the NATS plane (issue 24): a registration that claims another worker's
JetStream subject (over HTTP or written straight into the shared-registry bucket) is refused and
never changes the owner's answers; a relayed batch larger than the server's max_payload never
leaves a hole in the stream; a publisher seq at or above 2^63 is relayed like any other."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest

import random

from indexer.shared_registry import SharedRegistry
from indexer.subscriber import Subscriber
from producer.publisher import ZmqEventPublisher
from router_api.relay import Relay, RelayWorker
from schemas.events import BlockStored, KVEventBatch
from support.jetstream import Replica, scores
from indexer.index import KVIndex
from transport.jetstream_publisher import JetStreamEventPublisher
from schemas.api import RegisterWorker
from schemas.jetstream import DEFAULT_KV_BUCKET, jetstream_endpoint
from transport.natsio import NatsThread
from support.jetstream import subject_last_seq
from support.nats import NatsServer
from support.net import free_port, wait_until
from support.service import KVIndexerProcess, WorkerSim, check_scores, make_prompts, snapshot_marks

BS = 4
MODEL = "default"


def _rows(r: KVIndexerProcess) -> dict[str, dict]:
    return {w["worker_id"]: w for w in r.client.get("/workers").json()["workers"]}


def _drive(pub: JetStreamEventPublisher, sim: WorkerSim, steps: int) -> None:
    for _ in range(steps):
        pub.publish(sim.step())
    assert pub.flush(10.0)


def _applied(r: KVIndexerProcess, wid: str, mark: int) -> None:
    wait_until(lambda: (_rows(r).get(wid, {}).get("last_seq") or 0) >= mark, timeout=30.0, interval=0.05)


@contextmanager
def replica_bucket_and_publisher(nats: NatsServer, tmp_path: Path
                                 ) -> Iterator[tuple[KVIndexerProcess, SharedRegistry, JetStreamEventPublisher]]:
    """A `--nats` indexer process, the shared registry bucket (its own NATS connection) and worker
    "a"'s JetStream publisher; all closed afterwards."""
    r = KVIndexerProcess(free_port(), "--nats", nats.url, "--block-size", str(BS), log_path=tmp_path / "r.log")
    r.wait_ready()
    nt = NatsThread(nats.url)
    bucket = SharedRegistry(nt, DEFAULT_KV_BUCKET)
    pub = JetStreamEventPublisher(nats.url, model=MODEL, worker_id="a")
    try:
        yield r, bucket, pub
    finally:
        pub.close()
        bucket.close()
        nt.close()
        r.terminate()


def test_a_jetstream_subject_has_one_worker_over_http_and_the_bucket(nats: NatsServer, tmp_path: Path) -> None:
    with replica_bucket_and_publisher(nats, tmp_path) as (r, bucket, pub):
        sim = WorkerSim(1, BS, make_prompts(7, BS))
        own = jetstream_endpoint(MODEL, "a")
        assert r.client.post("/workers", json={"worker_id": "a", "endpoint": own, "block_size": BS}).status_code == 201
        # The same subject under another id (the topic is no ZeroMQ filter here) is refused.
        for body in ({"worker_id": "thief", "endpoint": own, "block_size": BS, "topic": "x"},
                     {"worker_id": "thief", "endpoint": own, "block_size": BS}):
            resp = r.client.post("/workers", json=body)
            assert resp.status_code in (400, 409), resp.text
            assert "subject" in resp.text or "already registered" in resp.text, resp.text
        # Written straight into the bucket: every replica refuses to apply it (counted).
        bucket.put(RegisterWorker(worker_id="thief", endpoint=own, block_size=BS, topic="x"))
        wait_until(lambda: 'kvatlas_shared_registry_errors_total{op="apply_put"}' in r.client.get("/metrics").text,
                   timeout=20.0, interval=0.05)
        assert set(_rows(r)) == {"a"}
        _drive(pub, sim, 30)
        _applied(r, "a", subject_last_seq(pub))
        queries = sim.sample_queries(10)
        assert check_scores(r.client, {"a": sim}, queries) == len(queries)
        # The hostile entry deleted: the owner still gets its new blocks.
        bucket.delete("thief")
        _drive(pub, sim, 30)
        _applied(r, "a", subject_last_seq(pub))
        queries = sim.sample_queries(10)
        assert check_scores(r.client, {"a": sim}, queries) == len(queries)


def _big_store(rng: random.Random, n_blocks: int, parent: int | None = None) -> BlockStored:
    """One BlockStored of `n_blocks` chained blocks (token ids over 2^16: 5 msgpack bytes each)."""
    tokens = [rng.randrange(1 << 20, 1 << 30) for _ in range(n_blocks * BS)]
    return BlockStored([rng.randrange(1, 1 << 62) for _ in range(n_blocks)], parent, tokens, BS)


def _relay_until(relay: Relay, replica: Replica, engine: ZmqEventPublisher, wid: str) -> None:
    target = engine.next_seq - 1

    def relayed() -> bool:
        engine.heartbeat()
        engine.flush(1.0)
        relay.step(20)
        replica.pump(0)
        return relay.sub.watermark(wid) is not None and relay.sub.watermark(wid) >= target and relay.flush(5.0)
    wait_until(relayed, timeout=90.0, interval=0.0)
    last = subject_last_seq(relay.pubs[wid])
    wait_until(lambda: (replica.pump(10), (replica.sub.watermark(wid) or 0) >= last)[1], timeout=90.0, interval=0.0)


def test_a_relayed_batch_over_max_payload_is_stored_in_parts_never_a_hole(nats: NatsServer) -> None:
    """NATS's default max_payload is 1 MiB; ZeroMQ takes the same 1.7 MiB batch. The relay stores
    it as parts of one seq and the replica applies it whole: no gap, no resync, exact answers."""
    engine = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    relay = Relay(nats.url, [RelayWorker("w0", engine.endpoint, engine.replay_endpoint, MODEL, BS)],
                  replay_timeout=5.0, subscriber=Subscriber(replay_timeout=5.0))
    replica = Replica(nats.url, BS)
    replica.add("w0")
    ref = KVIndex()  # the same batches applied directly (the reference model is too slow at 70k blocks)
    ref.ensure_model(MODEL, BS)
    rng = random.Random(3)
    try:
        wait_until(lambda: (engine.heartbeat(), engine.flush(1.0), relay.step(20),
                            relay.sub.watermark("w0") is not None)[-1], timeout=60.0, interval=0.0)
        small = _big_store(rng, 8)
        big = _big_store(rng, 70_000, parent=small.block_hashes[-1])
        after = _big_store(rng, 8, parent=big.block_hashes[-1])
        for ev in (small, big, after):
            engine.publish([ev])
            ref.apply(MODEL, "w0", 0, KVEventBatch(0.0, [ev]))
        assert len(msgspec.msgpack.encode(KVEventBatch(0.0, [big]))) > 1024 * 1024
        _relay_until(relay, replica, engine, "w0")
        pub = relay.pubs["w0"]
        assert pub.stats.split_batches == 1 and pub.stats.parts >= 2 and pub.stats.send_errors == 0
        assert "Gap" not in replica.kinds() and "Restart" not in replica.kinds(), replica.kinds()
        assert replica.sub.stats.split_batches == 1 and replica.sub.stats.parts_dropped == 0
        queries = [small.token_ids, small.token_ids + big.token_ids[:400],
                   small.token_ids + big.token_ids + after.token_ids]
        assert scores(replica.index, queries) == scores(ref, queries)
        assert scores(replica.index, queries[-1:])[0][0][1] == 8 + 70_000 + 8
        # A replica that starts later reads the stream from its start and puts it together too.
        late = Replica(nats.url, BS)
        late.add("w0")
        try:
            late.catch_up({"w0": subject_last_seq(pub)}, timeout=90.0)
            assert scores(late.index, queries) == scores(ref, queries)
        finally:
            late.close()
    finally:
        relay.close()
        replica.close()
        engine.close()


def test_publisher_seqs_at_and_above_2_63_are_relayed(nats: NatsServer) -> None:
    """Wire seqs are u64: a publisher counting from 2^63 + 250 (past 2^63 - 1, across the
    fingerprint ring's wrap) is relayed batch by batch, and the replica's answers are exact."""
    import zmq

    from schemas.frames import seq_bytes

    port = free_port()
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    relay = Relay(nats.url, [RelayWorker("w0", f"tcp://127.0.0.1:{port}", None, MODEL, BS)], replay_timeout=1.0)
    replica = Replica(nats.url, BS)
    replica.add("w0")
    ref = KVIndex()
    ref.ensure_model(MODEL, BS)
    rng = random.Random(5)
    enc = msgspec.msgpack.Encoder()
    first = (1 << 63) + 250
    seq = first
    try:
        def send(events: list) -> None:
            nonlocal seq
            pub.send_multipart([b"", seq_bytes(seq), enc.encode(KVEventBatch(0.0, events))])
            seq += 1
        wait_until(lambda: (send([]), relay.step(20), relay.sub.watermark("w0") is not None)[-1],
                   timeout=10.0, interval=0.0)
        parent = None
        for _ in range(40):
            ev = _big_store(rng, 2, parent)
            parent = ev.block_hashes[-1]
            send([ev])
            ref.apply(MODEL, "w0", 0, KVEventBatch(0.0, [ev]))
            queries = [ev.token_ids]
        wait_until(lambda: (relay.step(20), relay.sub.watermark("w0") == seq - 1)[-1], timeout=20.0, interval=0.0)
        assert relay.flush(5.0) and relay.stats.forwarded >= 40
        assert relay.pubs["w0"].next_seq == seq
        replica.catch_up({"w0": subject_last_seq(relay.pubs["w0"])})
        kinds = replica.kinds()  # joined mid-stream: one gap before the first batch, then none
        assert kinds[0] == "Gap" and "Gap" not in kinds[1:] and "Restart" not in kinds, kinds
        assert scores(replica.index, queries) == scores(ref, queries)
    finally:
        relay.close()
        replica.close()
        pub.close(0)


def test_a_bucket_entry_that_cannot_be_registered_leaves_the_live_worker(nats: NatsServer, tmp_path: Path) -> None:
    """Re-registering a live worker in the bucket with a block size its model cannot take (the
    configured model is fixed at 4) is refused, counted, and the live worker keeps its state."""
    with replica_bucket_and_publisher(nats, tmp_path) as (r, bucket, pub):
        sim = WorkerSim(2, BS, make_prompts(9, BS))
        own = jetstream_endpoint(MODEL, "a")
        assert r.client.post("/workers", json={"worker_id": "a", "endpoint": own, "block_size": BS}).status_code == 201
        _drive(pub, sim, 20)
        _applied(r, "a", subject_last_seq(pub))
        bucket.put(RegisterWorker(worker_id="a", endpoint=own, block_size=BS * 2))
        wait_until(lambda: 'kvatlas_shared_registry_errors_total{op="apply_put"}' in r.client.get("/metrics").text,
                   timeout=20.0, interval=0.05)
        rows = _rows(r)
        assert set(rows) == {"a"} and rows["a"]["block_size"] == BS
        queries = sim.sample_queries(10)
        assert check_scores(r.client, {"a": sim}, queries) == len(queries)
        _drive(pub, sim, 10)
        _applied(r, "a", subject_last_seq(pub))
        assert check_scores(r.client, {"a": sim}, sim.sample_queries(10)) == 10




def test_replicas_at_the_same_last_seq_after_a_purge_agree_or_say_they_are_not_exact(
        nats: NatsServer, tmp_path: Path) -> None:
    """r2 is killed, the stream moves on and is purged, r2 restarts from its snapshot; the engine
    ignores snapshot requests. Both replicas reach the same last_seq; r1 is exact, and r2, whose
    view lost what the purge removed, says `exact: false` (also after its own restart)."""
    from schemas.jetstream import DEFAULT_STREAM

    snap1, snap2 = tmp_path / "r1.snap", tmp_path / "r2.snap"
    start = lambda name, snap: KVIndexerProcess(  # noqa: E731
        free_port(), "--nats", nats.url, "--block-size", str(BS), "--snapshot", str(snap),
        "--snapshot-interval", "0.2", log_path=tmp_path / f"{name}.log")
    r1, r2 = start("r1", snap1), start("r2", snap2)
    r1.wait_ready()
    r2.wait_ready()
    pub = JetStreamEventPublisher(nats.url, model=MODEL, worker_id="a", listen_snapshots=False)
    sim = WorkerSim(4, BS, make_prompts(11, BS))
    try:
        own = jetstream_endpoint(MODEL, "a")
        assert r1.client.post("/workers", json={"worker_id": "a", "endpoint": own, "block_size": BS}).status_code == 201
        _drive(pub, sim, 30)
        mark = subject_last_seq(pub)
        _applied(r1, "a", mark)
        _applied(r2, "a", mark)
        wait_until(lambda: snapshot_marks(snap2).get("a", -1) >= mark, timeout=20.0, interval=0.05)
        r2.kill()
        _drive(pub, sim, 100)
        nt = pub._nats
        nt.call(lambda: nt.js.purge_stream(DEFAULT_STREAM))
        _drive(pub, sim, 50)
        mark = subject_last_seq(pub)
        r2 = start("r2b", snap2)
        r2.wait_ready()
        _applied(r1, "a", mark)
        _applied(r2, "a", mark)
        row1, row2 = _rows(r1)["a"], _rows(r2)["a"]
        assert row1["last_seq"] == row2["last_seq"] == mark
        assert row1["exact"] is True and row2["exact"] is False, (row1, row2)
        queries = sim.sample_queries(10)
        assert check_scores(r1.client, {"a": sim}, queries) == len(queries)
        # The verdict survives r2's own restart (it is in the snapshot).
        wait_until(lambda: snapshot_marks(snap2).get("a", -1) >= mark, timeout=20.0, interval=0.05)
        assert r2.terminate() == 0
        r2 = start("r2c", snap2)
        r2.wait_ready()
        assert _rows(r2)["a"]["exact"] is False
    finally:
        pub.close()
        for r in (r1, r2):
            if r.proc.poll() is None:
                r.terminate()
