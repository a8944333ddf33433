"""The ingestion hot path: the subscriber's in-order shortcut agrees with `sequencing.on_live`,
framing is judged from each frame's `more` flag (malformed messages are counted, the stream around
them is intact), and the per-poll metric tally adds up to exactly what per-batch increments gave."""
from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import zmq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.net import wait_until
from support.service import service_with_publisher
from indexer.sequencing import DeliverStep, SeqTracker, on_live
from indexer.deliveries import Batch, Gap
from indexer.subscriber import Subscriber
from producer.page_hash import page_ids
from router_api.ingest_stats import Tally, record_apply_stats
from router_api.metrics import Counter, ServiceMetrics
from schemas.events import BlockStored

BS = 4
seqs = st.integers(min_value=0, max_value=12)


@settings(max_examples=400, deadline=None)
@given(last=st.none() | seqs, live_last=st.none() | seqs, seq=seqs)
def test_take_next_is_exactly_on_lives_trivial_case(last: int | None, live_last: int | None, seq: int) -> None:
    fast = SeqTracker(last)
    fast.live_last = live_last
    slow = copy.copy(fast)

    def no_replay(first: int, last_: int) -> list[tuple[int, str]]:
        raise AssertionError("the in-order case never replays")

    if fast.take_next(seq):
        steps = on_live(slow, seq, "item", no_replay)
        assert len(steps) == 1 and isinstance(steps[0], DeliverStep)
        assert (steps[0].seq, steps[0].item, steps[0].replayed) == (seq, "item", False)
        assert (fast.last, fast.live_last) == (slow.last, slow.live_last) == (seq, seq)
    else:  # untouched: the caller hands the message to on_live
        assert (fast.last, fast.live_last) == (last, live_last)


@contextmanager
def raw_publisher_and_subscriber() -> Iterator[tuple[zmq.Socket, int, Subscriber]]:
    """A bare ZMQ PUB on a free port (frames sent by hand) and a Subscriber; all closed afterwards."""
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUB)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    sub = Subscriber(ctx)
    try:
        yield raw, port, sub
    finally:
        sub.close()
        raw.close(0)
        ctx.term()


def test_malformed_frames_are_counted_and_the_stream_around_them_is_intact() -> None:
    with raw_publisher_and_subscriber() as (raw, port, sub):
        sub.add("w", f"tcp://127.0.0.1:{port}")
        got: list = []

        def joined() -> bool:  # seq 0 re-sent until the subscription is up (PUB drops before that)
            raw.send_multipart([b"", (0).to_bytes(8, "big"), b"p0"])
            got.extend(sub.poll(10))
            return bool(got)
        wait_until(joined, timeout=10)
        assert isinstance(got[0], Batch) and got[0].seq == 0
        bad_before = sub.stats.bad_frames
        got.clear()
        # Valid 1..6, with every kind of malformed message between them.
        raw.send_multipart([b"", (1).to_bytes(8, "big"), b"p1"])
        raw.send(b"lonely")                                             # 1 frame
        raw.send_multipart([b"", (2).to_bytes(8, "big"), b"p2"])
        raw.send_multipart([b"", (9).to_bytes(8, "big")])               # 2 frames
        raw.send_multipart([b"", (3).to_bytes(8, "big"), b"p3"])
        raw.send_multipart([b"", (9).to_bytes(8, "big"), b"x", b"y"])  # 4 frames
        raw.send_multipart([b"", (4).to_bytes(8, "big"), b"p4"])
        raw.send_multipart([b"", b"short", b"x"])                       # bad seq frame
        raw.send_multipart([b"", (5).to_bytes(8, "big"), b"p5"])
        raw.send_multipart([b"", (6).to_bytes(8, "big"), b"p6"])

        def all_in() -> bool:
            got.extend(d for d in sub.poll(10) if not (isinstance(d, Batch) and d.seq == 0))
            return any(isinstance(d, Batch) and d.seq == 6 for d in got)
        wait_until(all_in, timeout=10)
        # Nothing valid was lost or misread: no gap, every payload exactly as sent, in order.
        assert not any(isinstance(d, Gap) for d in got)
        assert [(d.seq, d.payload, d.replayed) for d in got] == [(s, b"p%d" % s, False) for s in range(1, 7)]
        assert sub.stats.bad_frames - bad_before == 4
        assert sub.watermark("w") == 6


def test_inc_many_equals_repeated_inc() -> None:
    a = Counter("a", "a", ("x", "y"))
    b = Counter("b", "b", ("x", "y"))
    incs = [(("p", "q"), 2), (("p", "r"), 1), (("p", "q"), 5)]
    for labels, n in incs:
        a.inc(*labels, amount=n)
    tally: dict[tuple[str, ...], float] = {}
    for labels, n in incs:
        tally[labels] = tally.get(labels, 0) + n
    b.inc_many(tally)
    assert a.items() == b.items() == [(("p", "q"), 7.0), (("p", "r"), 1.0)]
    try:
        b.inc_many({("only-one",): 1})
    except ValueError as exc:
        assert "takes labels" in str(exc)
    else:
        raise AssertionError("wrong label count must be rejected")


def test_tally_matches_record_apply_stats_and_spots_clears() -> None:
    from indexer.core.types import ApplyStats

    stats = [ApplyStats({("stored", "GPU", "new"): 3}, {}),
             ApplyStats({("stored", "GPU", "duplicate"): 2, ("cleared", "ALL", "cleared"): 1}, {"unknown_medium": 1}),
             ApplyStats({("stored", "GPU", "new"): 4}, {}, resync_needed=True)]
    direct = ServiceMetrics()
    verdicts_direct = [record_apply_stats(direct, s) for s in stats]
    batched = ServiceMetrics()
    tally = Tally()
    verdicts_tally = [tally.add_stats(s) for s in stats]
    assert batched.events.items() == []  # nothing reaches the metrics before the flush
    tally.flush(batched)
    assert verdicts_direct == verdicts_tally == [(False, False), (False, True), (True, False)]
    assert direct.events.items() == batched.events.items()
    assert direct.drops.items() == batched.drops.items() == [(("unknown_medium",), 1.0)]
    assert tally.events == {} and tally.drops == {}


def test_service_counts_every_batch_and_block_through_the_fast_path() -> None:
    with service_with_publisher(BS) as (svc, pub):
        base_live = svc.metrics.batches.get("w0", "live")
        base_gaps, base_drops = svc.metrics.gaps.total(), svc.metrics.drops.total()  # slow-joiner losses
        n, per = 300, 3
        toks = [(7 * i) % 32000 for i in range(n * per * BS)]
        ids = page_ids(toks, BS)
        for b in range(n):
            lo, hi = b * per, (b + 1) * per
            pub.publish([BlockStored(ids[lo:hi], ids[lo - 1] if lo else None, toks[lo * BS:hi * BS], BS, None, "GPU")])
        assert pub.flush(10)
        last = pub.next_seq - 1
        wait_until(lambda: svc.registry.get("w0").last_seq == last, timeout=20)
        # Flushed once per poll: poll until the tally of the final poll has landed.
        wait_until(lambda: svc.metrics.batches.get("w0", "live") - base_live == n, timeout=30)
        assert svc.metrics.events.get("stored", "GPU", "new") == n * per
        assert (svc.metrics.gaps.total(), svc.metrics.drops.total()) == (base_gaps, base_drops)
        assert svc.score("default", toks).workers[0].device_blocks == n * per
        assert svc.registry.get("w0").batches >= n
        assert svc.metrics.worker_lag.get("w0") >= 0.0


def test_a_stray_copy_is_not_a_restart_and_a_restart_still_is() -> None:
    """A seq that went back with the payload already delivered at that seq is a stray copy (dropped,
    counted as a duplicate: no clear, no replay); a different payload at a passed seq is a restart
    (docs/service.md, "Replays")."""
    with raw_publisher_and_subscriber() as (raw, port, sub):
        sub.add("w", f"tcp://127.0.0.1:{port}")
        got: list = []

        def send(seq: int, tag: str = "p") -> None:  # a real publisher's payloads carry their ts
            raw.send_multipart([b"", seq.to_bytes(8, "big"), f"{tag}{seq}".encode()])

        def joined() -> bool:
            send(0)
            got.extend(sub.poll(10))
            return bool(got)
        wait_until(joined, timeout=10)
        got.clear()
        for seq in (1, 2, 3, 2, 4, 1, 3, 5):  # a duplicate, then two late copies in a row
            send(seq)

        def upto(seq: int) -> Any:
            def ok() -> bool:
                got.extend(sub.poll(10))
                return any(isinstance(d, Batch) and d.seq == seq and not d.replayed for d in got)
            return ok
        wait_until(upto(5), timeout=10)
        live = [d for d in got if not (isinstance(d, Batch) and d.seq == 0)]
        assert [(type(d).__name__, getattr(d, "seq", None)) for d in live] == [("Batch", s) for s in range(1, 6)]
        assert sub.stats.duplicates == 3 and sub.stats.restarts == 0
        got.clear()
        for seq in (0, 1, 2):  # the publisher restarted: without a replay endpoint, nothing is lost
            send(seq, "r")
        wait_until(upto(2), timeout=10)
        assert [(type(d).__name__, getattr(d, "seq", getattr(d, "new_seq", None))) for d in got] == [
            ("Restart", 0), ("Batch", 0), ("Batch", 1), ("Batch", 2)]
        assert sub.stats.restarts == 1


def test_batches_the_accelerator_declines_are_counted_by_reason_in_metrics() -> None:
    """A raw batch the C walk hands to the pure core (here: a LoRA-named store) is answered the same,
    and /metrics says why it was not on the fast path (kvatlas_native_declines{reason})."""
    from indexer.core import native as native_core

    if not native_core.available():
        pytest.skip("native accelerator not built")

    def declined(text: str) -> float:
        line = next((ln for ln in text.splitlines() if ln.startswith('kvatlas_native_declines{reason="lora_or_salt"}')), None)
        return float(line.rsplit(" ", 1)[1]) if line else 0.0

    with service_with_publisher(BS) as (svc, pub):
        before = declined(svc.metrics_text())
        toks = list(range(1, 2 * BS + 1))
        ids = page_ids(toks, BS)
        pub.publish([BlockStored(ids, None, toks, BS, None, "GPU", lora_name="adapter")])
        assert pub.flush(10)
        last = pub.next_seq - 1
        wait_until(lambda: svc.registry.get("w0").last_seq == last, timeout=20)
        assert declined(svc.metrics_text()) >= before + 1
        assert svc.score("default", toks, lora_name="adapter").workers[0].cached_blocks == 2
