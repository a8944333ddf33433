"""Resync by snapshot: a loss the replay buffer cannot cover is repaired exactly, at once, by
asking the producer to re-publish its state in-stream (real caches, real ZeroMQ)."""
from __future__ import annotations


from support.net import wait_until
from indexer.index import KVIndex
from indexer.deliveries import Batch, Gap, Restart
from indexer.subscriber import Subscriber
from producer.publisher import ZmqEventPublisher
from support.service import publishing_driver

MODEL, WID, PAGE = "m", "w0", 4
MASK = (1 << 64) - 1


def index_view(index: KVIndex) -> set[tuple[int, str]]:
    return {(h, e.medium) for wid, _r, evs in index.dump(MODEL) if wid == WID for e in evs for h in e.block_hashes}


def cache_view(cache) -> set[tuple[int, str]]:  # noqa: ANN001
    return {(i & MASK, m.name) for i, m in cache.resident_blocks()}


def test_loss_beyond_replay_buffer_is_repaired_by_an_in_stream_snapshot() -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_steps=3)
    cache, driver, requests = publishing_driver(pub, 120, 3, PAGE)
    lost: set[int] = set()
    sub = Subscriber(replay_timeout=5.0, drop_live=lambda _w, seq: seq in lost)
    sub.add(WID, pub.endpoint, pub.replay_endpoint)
    index = KVIndex()
    index.ensure_model(MODEL, PAGE)
    applied = {"seq": -1, "unrecovered": 0, "snapshots_asked": 0}

    def pump(timeout_ms: int = 20) -> None:
        for d in sub.poll(timeout_ms):
            if isinstance(d, Batch):
                index.apply_payload(MODEL, d.worker_id, 0, d.payload)
                applied["seq"] = d.seq
            elif isinstance(d, Gap) and not d.recovered:
                applied["unrecovered"] += 1
                index.clear_worker(MODEL, d.worker_id)
                applied["snapshots_asked"] += sub.request_snapshot(d.worker_id)
            elif isinstance(d, Restart):
                index.clear_worker(MODEL, d.worker_id)

    def caught_up() -> bool:
        pub.flush(30.0)
        pump()
        return applied["seq"] >= pub.next_seq - 1

    try:
        pub.heartbeat()
        assert wait_until(lambda: (pub.heartbeat(), caught_up())[1], timeout=60)  # slow joiner
        half = len(requests) // 2
        for tokens in requests[:half]:
            driver.serve(tokens)
        cache.wait_transfers(60.0)
        cache.step()
        assert wait_until(caught_up, timeout=60)
        assert index_view(index) == cache_view(cache)

        # Lose 10 batches on the wire: far more than the 3-batch replay buffer holds.
        lost.update(range(pub.next_seq, pub.next_seq + 10))
        for tokens in requests[half:half + 10]:
            driver.serve(tokens)  # one step, one batch each
        cache.wait_transfers(60.0)
        cache.step()
        while pub.next_seq <= max(lost) + 1:  # a step with nothing to say sends no batch: top up
            pub.heartbeat()
            pub.flush(30.0)
        # the first live batch after the lost range reveals the gap
        assert wait_until(lambda: (pump(), applied["unrecovered"])[1] >= 1, timeout=60)
        assert applied["unrecovered"] == applied["snapshots_asked"] == 1, applied
        # The producer sees the request on its replay socket; its next step publishes the state.
        assert wait_until(lambda: pub.stats.snapshot_requests >= 1, timeout=60)
        assert pub.stats.snapshot_requests == 1
        snap_seq = pub.next_seq
        cache.step()
        assert wait_until(lambda: (pump(), applied["seq"] >= snap_seq)[1], timeout=60)
        # Exact right after the snapshot batch — not only after later churn happens to refresh it.
        assert cache.stats.get("snapshots") == 1
        assert index_view(index) == cache_view(cache)
        assert len(cache_view(cache)) > 0

        # And the stream goes on exactly from there.
        for tokens in requests[half + 10:]:
            driver.serve(tokens)
        cache.wait_transfers(60.0)
        cache.step()
        assert wait_until(caught_up, timeout=60)
        assert index_view(index) == cache_view(cache)
    finally:
        cache.transfer.close()
        pub.close()
        sub.close()


def test_engines_without_the_extension_are_unharmed() -> None:
    """A snapshot request to a publisher that only speaks the engines' replay protocol gets at most
    an end marker; replays on that worker keep working."""
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    sub = Subscriber(replay_timeout=1.0)
    try:
        sub.add(WID, pub.endpoint, pub.replay_endpoint)
        assert sub.request_snapshot(WID) is True
        assert sub.request_snapshot("nobody") is False
        assert wait_until(lambda: pub.stats.snapshot_requests == 1, timeout=30)
        assert pub.snapshot_requested() is True and pub.snapshot_requested() is False  # consumed once
        assert pub.stats.bad_replay_requests == 0
    finally:
        pub.close()
        sub.close()
