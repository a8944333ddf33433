"""JetStream event plane against a real `nats-server -js`: replicas that agree, late and restarted
replicas that catch up exactly from the stream, trimmed streams, publisher restarts."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from indexer.deliveries import Batch, Gap
from indexer.jetstream_sequencing import Step, StepKind, StreamCursor
from support.reference import ReferenceIndex
from support.jetstream import MODEL, Replica, scores, stream_last_seq, wait_all_applied
from transport.jetstream_publisher import JetStreamEventPublisher
from schemas.codec import decode_batch
from schemas.events import KVEventBatch
from schemas.jetstream import StreamSettings, event_subject, jetstream_endpoint, split_subject, subject_token
from support.nats import NatsServer
from support.service import WorkerSim, make_prompts

BS = 4


def _drive(pubs: dict[str, JetStreamEventPublisher], sims: dict[str, WorkerSim], steps: int,
           ref: ReferenceIndex | None = None) -> None:
    for _ in range(steps):
        for wid, sim in sims.items():
            events = sim.step()
            pubs[wid].publish(events)
            if ref is not None:
                ref.apply(MODEL, wid, 0, KVEventBatch(0.0, events))
    for p in pubs.values():
        assert p.flush(10.0)


def _fleet(url: str, n: int, settings: StreamSettings | None = None):
    sims = {f"w{i}": WorkerSim(i, BS, make_prompts(10 + i, BS)) for i in range(n)}
    pubs = {wid: JetStreamEventPublisher(url, model=MODEL, worker_id=wid, stream=settings) for wid in sims}
    return sims, pubs


def _queries(sims: dict[str, WorkerSim]) -> list[list[int]]:
    return [q for s in sims.values() for q in s.sample_queries(15)]


def close_all(replica: Replica, pubs: dict[str, JetStreamEventPublisher]) -> None:
    replica.close()
    for p in pubs.values():
        p.close()


def test_subject_tokens_are_reversible_and_safe() -> None:
    for name in ["w0", "a.b", "x y>*", "ünï", "%20", "-_"]:
        tok = subject_token(name)
        assert not set(tok) & set(". *>")
        subject = event_subject("m.1", name)
        assert split_subject(subject, "kvatlas.events") == ("m.1", name)
    with pytest.raises(ValueError):
        subject_token("")


def test_cursor_rules() -> None:
    c = StreamCursor()
    assert c.take(1, "e1", 0) == []
    assert c.take(3, "e1", 1) == []
    assert c.take(4, "e1", 1) is None  # duplicate publisher seq
    assert c.take(7, "e1", 3) == [Step(StepKind.GAP, 5, 6)]
    assert c.take(9, "e2", 0) == [Step(StepKind.RESTART, 7, 9)]
    assert c.take(12, "e3", 2) == [Step(StepKind.RESTART, 9, 12), Step(StepKind.GAP, 10, 11)]
    fresh = StreamCursor()
    assert fresh.take(5, "e", 3) == [Step(StepKind.GAP, 0, 4)]
    resumed = StreamCursor(10, maybe_trimmed=True)
    assert resumed.take(20, "e", 4) == [Step(StepKind.GAP, 11, 19)]
    assert StreamCursor(10).take(11, "e", 4) == []
    assert StreamCursor(10).take(11, "e", 0) == [Step(StepKind.RESTART, 10, 11)]


@pytest.mark.parametrize("shared", [False, True], ids=["per_worker", "shared"])
def test_two_replicas_agree_with_the_reference_and_a_late_one_catches_up(nats: NatsServer, shared: bool) -> None:
    sims, pubs = _fleet(nats.url, 3)
    ref = ReferenceIndex()
    ref.ensure_model(MODEL, BS)
    a, b = Replica(nats.url, BS, shared=shared), Replica(nats.url, BS, shared=shared)
    late = None
    try:
        for wid in sims:
            a.add(wid)
            b.add(wid)
        _drive(pubs, sims, 60, ref)
        for r in (a, b):
            wait_all_applied(r, pubs)
        late = Replica(nats.url, BS, shared=shared)  # started after the fleet published everything
        for wid in sims:
            late.add(wid)
        _drive(pubs, sims, 30, ref)
        for r in (a, b, late):
            wait_all_applied(r, pubs)
        queries = _queries(sims)
        want = scores(ref, queries)
        assert scores(a.index, queries) == want
        assert scores(b.index, queries) == want
        assert scores(late.index, queries) == want
        assert {wid: a.sub.watermark(wid) for wid in sims} == {wid: b.sub.watermark(wid) for wid in sims}
        assert "Gap" not in a.kinds() and "Restart" not in a.kinds()
        assert late.sub.stats.replay_batches > 0
    finally:
        for r in (a, b, late):
            if r is not None:
                r.close()
        for p in pubs.values():
            p.close()


@pytest.mark.parametrize("shared", [False, True], ids=["per_worker", "shared"])
def test_restarted_replica_continues_exactly_from_its_watermark(nats: NatsServer, shared: bool) -> None:
    sims, pubs = _fleet(nats.url, 2)
    ref = ReferenceIndex()
    ref.ensure_model(MODEL, BS)
    r = Replica(nats.url, BS, shared=shared)
    try:
        for wid in sims:
            r.add(wid)
        _drive(pubs, sims, 40, ref)
        wait_all_applied(r, pubs)
        marks = {wid: r.sub.watermark(wid) for wid in sims}
        dump = r.index.dump(MODEL)  # what a snapshot would hold
        r.close()
        _drive(pubs, sims, 40, ref)  # published while the replica is down
        r = Replica(nats.url, BS, shared=shared)
        r.index.load_dump(MODEL, BS, dump)
        for wid in sims:
            r.add(wid, last_seq=marks[wid])
        wait_all_applied(r, pubs)
        assert "Gap" not in r.kinds() and "Restart" not in r.kinds()
        assert all(isinstance(d.seq, int) and d.seq > marks[d.worker_id] for d in r.log)
        queries = _queries(sims)
        assert scores(r.index, queries) == scores(ref, queries)
    finally:
        close_all(r, pubs)


@pytest.mark.parametrize("shared", [False, True], ids=["per_worker", "shared"])
def test_trimmed_stream_gives_an_unrecovered_gap(nats: NatsServer, shared: bool) -> None:
    settings = StreamSettings(name="TRIM", max_bytes=0)
    sims, pubs = _fleet(nats.url, 1, settings)
    r = Replica(nats.url, BS, stream=settings, shared=shared)
    try:
        r.add("w0")
        _drive(pubs, sims, 10)
        wait_all_applied(r, pubs)
        mark = r.sub.watermark("w0")
        r.close()
        _drive(pubs, sims, 10)
        nt = pubs["w0"]._nats
        js = nt.js
        purge_upto = stream_last_seq(pubs["w0"]) - 3  # retention removed everything but the tail
        nt.call(lambda: js.purge_stream("TRIM", seq=purge_upto))
        r = Replica(nats.url, BS, stream=settings, shared=shared)
        r.add("w0", last_seq=mark)
        wait_all_applied(r, pubs)
        gaps = [d for d in r.log if isinstance(d, Gap)]
        assert len(gaps) == 1 and not gaps[0].recovered
        assert r.kinds()[0] == "Gap"
        # A fresh replica reading a stream whose start was trimmed is told the same.
        fresh = Replica(nats.url, BS, stream=settings, shared=shared)
        fresh.add("w0")
        wait_all_applied(fresh, pubs)
        assert fresh.kinds()[0] == "Gap" and not fresh.log[0].recovered
        fresh.close()
    finally:
        close_all(r, pubs)


def test_publisher_restart_is_a_restart_and_snapshot_requests_reach_it(nats: NatsServer) -> None:
    from support.net import wait_until

    sims, pubs = _fleet(nats.url, 1)
    r = Replica(nats.url, BS)
    try:
        r.add("w0")
        _drive(pubs, sims, 5)
        wait_all_applied(r, pubs)
        assert r.sub.request_snapshot("w0")
        wait_until(pubs["w0"].snapshot_requested, timeout=30.0)
        pubs["w0"].close()
        pubs["w0"] = JetStreamEventPublisher(nats.url, model=MODEL, worker_id="w0")
        sims["w0"].clear()
        _drive(pubs, sims, 5)
        wait_all_applied(r, pubs)
        assert r.kinds().count("Restart") == 1 and "Gap" not in r.kinds()
        # payloads are the exact bytes
        batches = [d for d in r.log if isinstance(d, Batch)]
        assert all(not isinstance(decode_batch(b.payload), Exception) for b in batches)
    finally:
        close_all(r, pubs)


def test_bad_messages_are_counted_not_fatal(nats: NatsServer) -> None:
    sims, pubs = _fleet(nats.url, 1)
    r = Replica(nats.url, BS)
    try:
        r.add("w0")
        nt = pubs["w0"]._nats
        subject = pubs["w0"].subject
        nt.call(lambda: nt.js.publish(subject, b"junk"))
        _drive(pubs, sims, 3)
        wait_all_applied(r, pubs)
        assert r.sub.stats.bad_frames == 1
        assert r.kinds() == ["Batch"] * 3
        with pytest.raises(ValueError):
            r.sub.add("x", "tcp://127.0.0.1:1")
        with pytest.raises(ValueError):
            r.sub.add("w0", jetstream_endpoint(MODEL, "w0"))
    finally:
        close_all(r, pubs)


def test_routed_subscriber_serves_zeromq_and_jetstream_workers(nats: NatsServer) -> None:
    from support.net import free_port, wait_until
    from indexer.jetstream_subscriber import JetStreamSubscriber
    from indexer.routed_subscriber import RoutedSubscriber
    from indexer.subscriber import Subscriber
    from producer.publisher import ZmqEventPublisher

    zpub = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    jpub = JetStreamEventPublisher(nats.url, model=MODEL, worker_id="j0")
    sub = RoutedSubscriber(Subscriber(), JetStreamSubscriber(nats.url))
    got: list = []
    try:
        sub.add("z0", zpub.endpoint, replay_endpoint=zpub.replay_endpoint)
        sub.add("j0", jetstream_endpoint(MODEL, "j0"))
        assert sorted(sub.workers()) == ["j0", "z0"]
        jpub.heartbeat()

        def both() -> bool:
            zpub.heartbeat()
            got.extend(sub.poll(20))
            return {d.worker_id for d in got} == {"j0", "z0"}
        wait_until(both, timeout=10.0, interval=0.0)
        assert sub.watermark("j0") == 1 and sub.request_snapshot("j0")
        sub.remove("z0")
        with pytest.raises(KeyError):
            sub.remove("z0")
    finally:
        sub.close()
        zpub.close()
        jpub.close()


def test_shared_consumer_serves_a_worker_added_after_it_moved_on(nats: NatsServer) -> None:
    sims, pubs = _fleet(nats.url, 2)
    ref = ReferenceIndex()
    ref.ensure_model(MODEL, BS)
    r = Replica(nats.url, BS, shared=True)
    try:
        r.add("w0")
        _drive(pubs, sims, 30, ref)
        wait_all_applied(r, {"w0": pubs["w0"]})
        r.add("w1")  # its whole history lies behind the shared consumer's position
        _drive(pubs, sims, 10, ref)
        wait_all_applied(r, pubs)
        assert "Gap" not in r.kinds() and "Restart" not in r.kinds()
        queries = _queries(sims)
        assert scores(r.index, queries) == scores(ref, queries)
        state = r.sub.stream_state()
        assert state["messages"] == 80 and state["bytes"] > 0
    finally:
        close_all(r, pubs)


@pytest.mark.parametrize("shared", [False, True], ids=["per_worker", "shared"])
def test_bounded_queue_and_slow_consumer_restarts_lose_nothing(nats: NatsServer, shared: bool) -> None:
    """A tiny in-process queue and NATS buffer: the callbacks wait for room, nats-py drops what
    overflows its buffer, the consumer restarts at the watermark, and the result is still exact."""
    sims, pubs = _fleet(nats.url, 2)
    ref = ReferenceIndex()
    ref.ensure_model(MODEL, BS)
    r = Replica(nats.url, BS, shared=shared, max_queue=4, sub_pending_msgs=8)
    try:
        for wid in sims:
            r.add(wid)
        r.pump(0)  # starts the shared consumer
        _drive(pubs, sims, 100, ref)  # 200 messages while nobody polls
        from support.net import wait_until
        wait_until(lambda: r.sub.stats.queue_full_waits > 0, timeout=10.0)
        assert r.sub.queued <= 4
        wait_all_applied(r, pubs)
        assert r.sub.queued <= 4
        assert r.sub.stats.slow_consumer_restarts > 0
        assert "Gap" not in r.kinds() and "Restart" not in r.kinds()
        queries = _queries(sims)
        assert scores(r.index, queries) == scores(ref, queries)
    finally:
        close_all(r, pubs)
