"""Publisher + subscriber over real ZeroMQ sockets on 127.0.0.1: gap recovery through replay,
unrecoverable gaps, restarts, late joiners, watermarks, engine-style replies, clean shutdown."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import msgspec
import pytest
import zmq

from indexer.deliveries import Batch, Delivery, Gap, Restart
from indexer.subscriber import Subscriber
from indexer.zmq_replay import parse_replay_reply
from schemas.frames import END_SEQ
from producer.publisher import ZmqEventPublisher
from schemas.codec import decode_batch
from schemas.events import BlockStored, KVEventBatch

LOOP = "tcp://127.0.0.1:*"
BLOCK = 16


def stored(batch_no: int, blocks: int) -> BlockStored:
    hashes = [batch_no * blocks + j for j in range(blocks)]
    parent = batch_no * blocks - 1 if batch_no else None
    tokens = [(h * 7 + t) % 32000 for h in hashes for t in range(BLOCK)]
    return BlockStored(hashes, parent, tokens, BLOCK, None, "GPU")


def collect(sub: Subscriber, done: Callable[[list[Delivery]], bool], timeout: float = 20.0,
            tick: Callable[[], None] | None = None) -> list[Delivery]:
    """Poll until `done(all deliveries so far)`; `tick` runs before each poll (e.g. a heartbeat)."""
    out: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while not done(out):
        if time.monotonic() > deadline:
            tail = [(type(d).__name__, d.worker_id, getattr(d, "seq", None)) for d in out[-3:]]
            raise AssertionError(f"timed out; got {len(out)} deliveries, last {tail}")
        if tick is not None:
            tick()
        out.extend(sub.poll(20))
    return out


def batches(ds: list[Delivery], worker: str | None = None) -> list[Batch]:
    return [d for d in ds if isinstance(d, Batch) and (worker is None or d.worker_id == worker)]


def has_seq(worker: str, seq: int) -> Callable[[list[Delivery]], bool]:
    return lambda ds: any(isinstance(d, Batch) and d.worker_id == worker and d.seq >= seq for d in ds)


def sync(pub: ZmqEventPublisher, sub: Subscriber, worker: str) -> list[Delivery]:
    """Heartbeat until the subscriber has received something live (PUB/SUB join is asynchronous)."""
    return collect(sub, lambda ds: any(isinstance(d, Batch) and not d.replayed for d in ds),
                   tick=pub.heartbeat)


@pytest.fixture
def pub() -> ZmqEventPublisher:
    p = ZmqEventPublisher(LOOP, replay_endpoint=LOOP)
    yield p
    p.close()


@pytest.fixture
def sub_factory():
    subs: list[Subscriber] = []

    def make(**kw) -> Subscriber:
        s = Subscriber(**kw)
        subs.append(s)
        return s

    yield make
    for s in subs:
        s.close()


def test_100k_blocks_with_dropped_range_fully_recovered(pub: ZmqEventPublisher, sub_factory) -> None:
    drop = {"lo": -1, "hi": -2}
    sub = sub_factory(drop_live=lambda w, s: drop["lo"] <= s <= drop["hi"])
    sub.add("w0", pub.endpoint, pub.replay_endpoint)
    sync(pub, sub, "w0")
    assert pub.flush(5)
    s0, n, per = pub.next_seq, 1600, 64  # 102,400 blocks
    drop["lo"], drop["hi"] = s0 + 300, s0 + 699
    for i in range(n):
        pub.publish([stored(i, per)], dp_rank=0)
    ds = collect(sub, has_seq("w0", s0 + n - 1), timeout=60)

    main = [b for b in batches(ds) if b.seq >= s0]
    assert [b.seq for b in main] == list(range(s0, s0 + n)), "every batch exactly once, in order"
    assert [b.seq for b in main if b.replayed] == list(range(drop["lo"], drop["hi"] + 1))
    gaps = [d for d in ds if isinstance(d, Gap) and d.first >= s0]
    assert gaps == [Gap("w0", drop["lo"], drop["hi"], True)]
    assert ds.index(gaps[0]) < ds.index(next(b for b in main if b.seq == drop["lo"]))
    seen: set[int] = set()
    for b in main:
        batch = decode_batch(b.payload)
        assert isinstance(batch, KVEventBatch)
        (ev,) = batch.events
        assert ev == stored(b.seq - s0, per)
        seen.update(ev.block_hashes)
    assert len(seen) == n * per >= 100_000
    assert sub.stats.dropped_by_hook == 400 and sub.stats.gaps_unrecovered == 0
    assert sub.watermark("w0") == s0 + n - 1


def test_gap_older_than_replay_buffer_is_reported_not_silent(sub_factory) -> None:
    with ZmqEventPublisher(LOOP, replay_endpoint=LOOP, buffer_steps=50) as pub:
        drop = {"lo": -1, "hi": -2}
        sub = sub_factory(drop_live=lambda w, s: drop["lo"] <= s <= drop["hi"])
        sub.add("w0", pub.endpoint, pub.replay_endpoint)
        sync(pub, sub, "w0")
        assert pub.flush(5)
        s0 = pub.next_seq
        drop["lo"], drop["hi"] = s0 + 100, s0 + 299
        for i in range(400):
            pub.publish([stored(i, 4)])
        assert pub.flush(5)  # all 400 sent: the buffer now holds only s0+350 .. s0+399
        ds = collect(sub, has_seq("w0", s0 + 399))
    main = [b.seq for b in batches(ds) if b.seq >= s0]
    assert main == [s for s in range(s0, s0 + 400) if not drop["lo"] <= s <= drop["hi"]]
    assert [d for d in ds if isinstance(d, Gap)] [-1:] == [Gap("w0", drop["lo"], drop["hi"], False)]
    assert sub.stats.gaps_unrecovered == 1
    assert sub.stats.replay_extra >= 1  # the buffer's newer batches were left to the live stream


def test_publisher_restart_on_same_endpoint_delivers_restart(free_port, sub_factory) -> None:
    ep, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    sub = sub_factory()
    pub1 = ZmqEventPublisher(ep, replay_endpoint=rep)
    try:
        sub.add("w0", ep, rep)
        sync(pub1, sub, "w0")
        for _ in range(200):
            pub1.publish([], dp_rank=1)
        assert pub1.flush(5)
        # Everything pub1 sent (sync's heartbeats included), not just seq 200: a batch still in
        # flight would move the watermark after old_last was read (the flake of sessions 2 and 3).
        before = collect(sub, has_seq("w0", pub1.next_seq - 1))
        old_last = sub.watermark("w0")
    finally:
        pub1.close()
    pub2 = ZmqEventPublisher(ep, replay_endpoint=rep)
    try:
        ds = collect(sub, lambda ds: any(isinstance(d, Restart) for d in ds)
                     and any(isinstance(d, Batch) for d in ds[[isinstance(x, Restart) for x in ds].index(True):]),
                     tick=lambda: pub2.heartbeat(dp_rank=2))
    finally:
        pub2.close()
    assert old_last is not None and old_last >= 200 and before
    ri = next(i for i, d in enumerate(ds) if isinstance(d, Restart))
    restart = ds[ri]
    assert isinstance(restart, Restart) and restart.old_seq == old_last and restart.new_seq <= old_last
    after = batches(ds[ri + 1:])
    # After the restart the new publisher's stream is delivered from seq 0 (earlier ones replayed).
    assert [b.seq for b in after] == list(range(len(after)))
    assert all(decode_batch(b.payload).data_parallel_rank == 2 for b in after)
    assert all(decode_batch(b.payload).data_parallel_rank == 1 for b in batches(ds[:ri]))


def test_late_subscriber_gets_earlier_batches_via_replay(pub: ZmqEventPublisher, sub_factory) -> None:
    originals = [stored(i, 3) for i in range(20)]
    for ev in originals:
        pub.publish([ev], dp_rank=7)
    assert pub.flush(5)
    sub = sub_factory()
    sub.add("late", pub.endpoint, pub.replay_endpoint, last_seq=None)
    ds = sync(pub, sub, "late")
    got = batches(ds)
    assert [b.seq for b in got] == list(range(len(got))) and len(got) > 20
    assert all(b.replayed for b in got[:20])
    assert [decode_batch(b.payload).events[0] for b in got[:20]] == originals
    first_live = next(b.seq for b in got if not b.replayed)
    assert [d for d in ds if isinstance(d, Gap)] == [Gap("late", 0, first_live - 1, True)]


def test_watermark_resumes_after_last_applied(pub: ZmqEventPublisher, sub_factory) -> None:
    for i in range(20):
        pub.publish([stored(i, 1)])
    assert pub.flush(5)
    sub = sub_factory()
    sub.add("w", pub.endpoint, pub.replay_endpoint, last_seq=11)
    got = batches(sync(pub, sub, "w"))
    assert got[0].seq == 12 and [b.seq for b in got] == list(range(12, 12 + len(got)))


def test_three_frame_engine_replies_are_accepted(zmq_ctx: zmq.Context, sub_factory) -> None:
    """vLLM 0.33 / SGLang 0.5.23 answer replays without the topic frame: [b"", seq, payload]."""
    pub_sock = zmq_ctx.socket(zmq.PUB)
    pub_sock.bind(LOOP)
    router = zmq_ctx.socket(zmq.ROUTER)
    router.bind(LOOP)
    sent: dict[int, bytes] = {}
    stop = threading.Event()

    def serve() -> None:  # the engines' replay loop, as they implement it
        while not stop.is_set():
            if not router.poll(20):
                continue
            ident, _, start_b = router.recv_multipart()
            start = int.from_bytes(start_b, "big")
            for s in sorted(sent):
                if s >= start:
                    router.send_multipart([ident, b"", s.to_bytes(8, "big"), sent[s]])
            router.send_multipart([ident, b"", END_SEQ, b""])

    server = threading.Thread(target=serve)
    server.start()
    try:
        sub = sub_factory()
        sub.add("eng", pub_sock.getsockopt_string(zmq.LAST_ENDPOINT),
                router.getsockopt_string(zmq.LAST_ENDPOINT))
        counter = iter(range(10_000))

        def send_next() -> None:
            s = next(counter)
            payload = msgspec.msgpack.encode([float(s), [], 0])
            sent[s] = payload
            if not 30 <= s <= 34:  # "lost on the wire", but present in the engine's buffer
                pub_sock.send_multipart([b"", s.to_bytes(8, "big"), payload])

        ds = collect(sub, has_seq("eng", 40), tick=send_next)
    finally:
        stop.set()
        server.join()
    got = batches(ds)
    assert [b.seq for b in got] == list(range(len(got)))
    assert all(b.payload == sent[b.seq] for b in got)
    assert Gap("eng", 30, 34, True) in ds


def test_parse_replay_reply_both_shapes() -> None:
    seq = (5).to_bytes(8, "big")
    assert parse_replay_reply([b"", b"topic", seq, b"p"]) == (5, b"p")
    assert parse_replay_reply([b"", seq, b"p"]) == (5, b"p")
    assert parse_replay_reply([b"", b"", END_SEQ, b""]) is None
    assert parse_replay_reply([b"", END_SEQ, b""]) is None
    assert isinstance(parse_replay_reply([b"", b"abc", b"p"]), str)
    assert isinstance(parse_replay_reply([b"x", seq, b"p"]), str)
    assert isinstance(parse_replay_reply([seq]), str)


def test_our_replay_replies_use_the_design_form(zmq_ctx: zmq.Context) -> None:
    with ZmqEventPublisher(LOOP, replay_endpoint=LOOP, topic="kv") as pub:
        for i in range(5):
            pub.publish([stored(i, 1)])
        assert pub.flush(5)
        dealer = zmq_ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", b"bad"])  # invalid request: counted, ignored, no crash
        dealer.send_multipart([b"", (3).to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(5000), "no replay reply"
            frames = dealer.recv_multipart()
            replies.append(frames)
            if frames[2] == END_SEQ:
                break
        assert pub.stats.bad_replay_requests == 1
    assert [f[:3] for f in replies[:-1]] == [[b"", b"kv", (s).to_bytes(8, "big")] for s in (3, 4)]
    assert replies[-1] == [b"", b"", END_SEQ, b""]
    assert decode_batch(replies[0][3]).events == [stored(3, 1)]


def test_many_publishers_one_subscriber(sub_factory) -> None:
    pubs = [ZmqEventPublisher(LOOP, replay_endpoint=LOOP, topic=f"t{i}") for i in range(3)]
    try:
        sub = sub_factory()
        for i, p in enumerate(pubs):
            sub.add(f"w{i}", p.endpoint, p.replay_endpoint, topic=f"t{i}")
        live = lambda ds, i: any(isinstance(d, Batch) and d.worker_id == f"w{i}" for d in ds)  # noqa: E731
        ds0 = collect(sub, lambda ds: all(live(ds, i) for i in range(3)),
                      tick=lambda: [p.heartbeat(dp_rank=i) for i, p in enumerate(pubs)])
        for i, p in enumerate(pubs):
            for j in range(100):
                p.publish([stored(j, 2)], dp_rank=i)
        ends = [p.next_seq - 1 if p.flush(5) else -1 for p in pubs]
        ds = ds0 + collect(sub, lambda ds: all(has_seq(f"w{i}", ends[i])(ds0 + ds) for i in range(3)))
    finally:
        for p in pubs:
            p.close()
    for i in range(3):
        got = batches(ds, f"w{i}")
        assert [b.seq for b in got] == list(range(len(got)))
        assert {decode_batch(b.payload).data_parallel_rank for b in got} == {i}
        assert sum(len(decode_batch(b.payload).events) for b in got) == 100
    sub.remove("w1")
    assert sub.workers() == ["w0", "w2"]
    with pytest.raises(KeyError):
        sub.remove("w1")


def test_malformed_live_frames_are_counted_not_fatal(zmq_ctx: zmq.Context, sub_factory) -> None:
    raw = zmq_ctx.socket(zmq.PUB)
    raw.bind(LOOP)
    sub = sub_factory()
    sub.add("w", raw.getsockopt_string(zmq.LAST_ENDPOINT))  # no replay endpoint
    counter = iter(range(1, 10_000))

    def send() -> None:
        raw.send_multipart([b"", b"short", b"x"])
        raw.send_multipart([b"", (0).to_bytes(8, "big")])
        raw.send_multipart([b"", next(counter).to_bytes(8, "big"), b"payload"])

    ds = collect(sub, lambda ds: bool(batches(ds)), tick=send)
    assert sub.stats.bad_frames >= 2
    first = batches(ds)[0]
    # No replay socket: the missing start is reported as unrecoverable, then the stream goes on.
    assert ds[0] == Gap("w", 0, first.seq - 1, False) and first.payload == b"payload"


def test_full_queue_blocks_caller_instead_of_dropping(sub_factory) -> None:
    with ZmqEventPublisher(LOOP, replay_endpoint=LOOP, max_queue=2) as pub:
        sub = sub_factory()
        sub.add("w", pub.endpoint, pub.replay_endpoint)
        sync(pub, sub, "w")
        assert pub.flush(5)
        s0 = pub.next_seq
        threads = [threading.Thread(target=lambda: [pub.heartbeat() for _ in range(1000)]) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ds = collect(sub, has_seq("w", s0 + 1999))
        # The count is kept after the send: a subscriber may see the last seq before it moves.
        assert pub.flush(5)
        assert pub.stats.published == s0 + 2000
    assert [b.seq for b in batches(ds) if b.seq >= s0] == list(range(s0, s0 + 2000))
    assert not [d for d in ds if isinstance(d, Gap)]


def test_close_is_fast_and_flushes_the_tail(sub_factory) -> None:
    # A 60 s linger and close timeout: a close that lingers waits them out, a sound one takes a moment
    # (the 30 s bound is that wide so a loaded host never trips it).
    pub = ZmqEventPublisher(LOOP, replay_endpoint=None, linger_ms=60_000)
    sub = sub_factory()
    sub.add("w", pub.endpoint)
    sync(pub, sub, "w")
    assert pub.flush(5)
    s0 = pub.next_seq
    for i in range(2000):
        pub.publish([stored(i, 2)])
    t = time.monotonic()
    pub.close(timeout=60.0)
    assert time.monotonic() - t < 30.0  # half the close timeout: a lingering close fails
    ds = collect(sub, has_seq("w", s0 + 1999))
    assert [b.seq for b in batches(ds) if b.seq >= s0] == list(range(s0, s0 + 2000)), "nothing lost"
    with pytest.raises(RuntimeError):
        pub.publish([])
    pub.close()  # idempotent

    # A publisher nobody listens to, and an idle subscriber, also close at once.
    t = time.monotonic()
    lonely = ZmqEventPublisher(LOOP, replay_endpoint=LOOP, linger_ms=60_000)
    for i in range(100):
        lonely.publish([stored(i, 1)])
    lonely.close(timeout=60.0)
    s = Subscriber()
    s.add("x", "tcp://127.0.0.1:1")  # nothing listens there
    s.poll(1)
    s.close()
    assert time.monotonic() - t < 30.0  # half the close timeout: a lingering close fails


def test_bad_arguments_give_clear_errors(sub_factory) -> None:
    with pytest.raises(ValueError, match="cannot bind"):
        ZmqEventPublisher("bogus://x")
    with pytest.raises(ValueError):
        ZmqEventPublisher(LOOP, max_queue=0)
    sub = sub_factory()
    with pytest.raises(ValueError, match="cannot connect"):
        sub.add("w", "nope")
    with pytest.raises(ValueError, match="watermark"):
        sub.add("w", LOOP.replace("*", "1"), last_seq=-5)
    sub.add("w", "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="already"):
        sub.add("w", "tcp://127.0.0.1:1")
    with ZmqEventPublisher(LOOP) as p, pytest.raises(TypeError):
        p.publish_payload("text")  # type: ignore[arg-type]
