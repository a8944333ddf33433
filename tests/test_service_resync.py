"""Resync by snapshot through the live service: a real producer cache publishing over real ZeroMQ
with a tiny replay buffer loses more batches than the buffer holds; the indexer service clears the
worker, asks the publisher for a snapshot, and the in-stream answer (AllBlocksCleared + the whole
state) makes the worker's view exact at once — not only after later churn refreshes it."""
from __future__ import annotations

from typing import Any

from support.net import free_port, wait_until
from indexer.subscriber import Subscriber
from producer.publisher import ZmqEventPublisher
from router_api.config import ServiceConfig
from support.service import LiveIndexer, publishing_driver, wait_applied

PAGE = 4
MASK = (1 << 64) - 1


def _index_view(client: Any, wid: str) -> set[tuple[int, str]]:
    """The worker's blocks as the service holds them (GET /dump), as (engine hash, medium)."""
    out: set[tuple[int, str]] = set()
    for entry in client.get("/dump").json()["models"]["default"]["workers"]:
        if entry["worker_id"] == wid:
            for ev in entry["events"]:
                out.update((h & MASK, ev["medium"]) for h in ev["block_hashes"])
    return out


def _cache_view(cache: Any) -> set[tuple[int, str]]:
    return {(i & MASK, m.name) for i, m in cache.resident_blocks()}


def _metric(client: Any, prefix: str, *contains: str) -> float:
    """Sum of the samples whose line starts with `prefix` and holds every `contains` label."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in client.get("/metrics").text.splitlines()
               if line.startswith(prefix) and all(c in line for c in contains))


class _Outage:
    """Drops w0's live batches with seq in [start, end) — end open while the outage lasts — and
    records what it dropped, so the test knows when the wire has really lost them."""

    def __init__(self) -> None:
        self.start: int | None = None
        self.end: int | None = None
        self.dropped: list[int] = []

    def __call__(self, wid: str, seq: int) -> bool:
        if wid != "w0" or self.start is None or seq < self.start or (self.end is not None and seq >= self.end):
            return False
        self.dropped.append(seq)
        return True


def test_loss_beyond_the_buffer_is_repaired_by_a_snapshot_at_once() -> None:
    outage = _Outage()
    li = LiveIndexer(
        ServiceConfig(port=free_port(), block_size=PAGE, replay_timeout_s=1.0, stats_ttl_s=0.0, resync_hold_s=60.0),
        subscriber_factory=lambda: Subscriber(replay_timeout=1.0, drop_live=outage),
    ).start()
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
                            buffer_steps=3)
    cache, driver, requests = publishing_driver(pub, 80, 5, PAGE)
    c = li.client
    try:
        r = c.post("/workers", json={"worker_id": "w0", "endpoint": pub.endpoint,
                                     "replay_endpoint": pub.replay_endpoint, "block_size": PAGE})
        assert r.status_code == 201, r.text

        def settle() -> None:
            pub.flush(5.0)
            wait_applied(c, {"w0": pub.next_seq - 1}, pubs={"w0": pub})

        pub.heartbeat()
        settle()  # subscription up (slow joiner)
        # A slow joiner may have lost more than the buffer already: then its snapshot request must
        # reach the publisher before we count (the next step answers it, in-stream).
        sent = 'kvatlas_snapshot_requests_total{outcome="sent",worker="w0"}'
        wait_until(lambda: pub.stats.snapshot_requests == _metric(c, sent), timeout=10, interval=0.02)
        for tokens in requests[:40]:
            driver.serve(tokens)
        cache.wait_transfers(10.0)
        cache.step()
        settle()
        assert _index_view(c, "w0") == _cache_view(cache) != set()
        before = {w["worker_id"]: w for w in c.get("/workers").json()["workers"]}["w0"]
        # Relative counts: a slow joiner may already have needed one resync (and snapshot) above.
        asked0, snaps0, sent0 = pub.stats.snapshot_requests, cache.stats.get("snapshots", 0), _metric(c, sent)

        # An outage on the wire while 10 requests are served: far more batches than the 3-batch
        # replay buffer holds. Nothing reaches the service until the outage ends, so the gap is
        # seen only afterwards (the service cannot ask for, nor the cache answer, a snapshot early).
        outage.start = pub.next_seq
        for tokens in requests[40:50]:
            driver.serve(tokens)
        cache.wait_transfers(10.0)
        cache.step()
        pub.flush(5.0)
        outage.end = pub.next_seq
        assert outage.end - outage.start > 3
        wait_until(lambda: len(outage.dropped) == outage.end - outage.start, timeout=10, interval=0.02)
        pub.heartbeat()  # the first live batch after the outage reveals the gap
        pub.flush(5.0)
        # The service sees the gap, resyncs, and asks the publisher for a snapshot.
        wait_until(lambda: pub.stats.snapshot_requests == asked0 + 1, timeout=10, interval=0.02)
        row = {w["worker_id"]: w for w in c.get("/workers").json()["workers"]}["w0"]
        assert row["status"] == "resyncing" and row["resyncs"] == before["resyncs"] + 1
        assert _metric(c, sent) == sent0 + 1

        # The producer's next step answers in-stream; right after that batch the view is exact.
        snap_seq = pub.next_seq
        cache.step()
        assert cache.stats.get("snapshots") == snaps0 + 1
        pub.flush(5.0)
        wait_applied(c, {"w0": snap_seq})
        assert _index_view(c, "w0") == _cache_view(cache) != set()
        row = {w["worker_id"]: w for w in c.get("/workers").json()["workers"]}["w0"]
        assert row["status"] == "live"  # the snapshot's AllBlocksCleared ended the resync
        assert row["resyncs"] == before["resyncs"] + 1  # one loss, one resync, no second clear
        assert _metric(c, 'kvatlas_events_applied_total{', 'type="cleared"') >= 1

        # And the stream goes on exactly from there.
        for tokens in requests[50:]:
            driver.serve(tokens)
        cache.wait_transfers(10.0)
        cache.step()
        settle()
        assert _index_view(c, "w0") == _cache_view(cache)
        assert pub.stats.snapshot_requests == asked0 + 1
    finally:
        cache.transfer.close()
        pub.close()
        li.stop()


def test_a_publisher_without_replay_endpoint_is_resynced_without_asking() -> None:
    """No replay endpoint: nothing to ask; the resync is still counted, the request as not sent."""
    lost: set[int] = set()
    li = LiveIndexer(
        ServiceConfig(port=free_port(), block_size=PAGE, replay_timeout_s=0.5, stats_ttl_s=0.0),
        subscriber_factory=lambda: Subscriber(replay_timeout=0.5, drop_live=lambda w, s: s in lost),
    ).start()
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}")
    c = li.client
    try:
        assert c.post("/workers", json={"worker_id": "w1", "endpoint": pub.endpoint,
                                        "block_size": PAGE}).status_code == 201
        pub.heartbeat()
        pub.flush(5.0)
        # Slow joiner: heartbeats sent before the SUB connected are lost for good (no replay) and
        # may already count as a resync; compare against the counters once the stream is up.
        wait_applied(c, {"w1": pub.next_seq - 1}, pubs={"w1": pub})
        base = {w["worker_id"]: w for w in c.get("/workers").json()["workers"]}["w1"]["resyncs"]
        asked = 'kvatlas_snapshot_requests_total{outcome="not_sent",worker="w1"}'
        assert _metric(c, asked) == base
        lost.update(range(pub.next_seq, pub.next_seq + 3))
        for _ in range(4):
            pub.heartbeat()
        pub.flush(5.0)
        wait_applied(c, {"w1": pub.next_seq - 1})
        row = {w["worker_id"]: w for w in c.get("/workers").json()["workers"]}["w1"]
        assert row["resyncs"] == base + 1
        assert _metric(c, asked) == base + 1
        assert _metric(c, 'kvatlas_snapshot_requests_total{outcome="sent",worker="w1"}') == 0
    finally:
        pub.close()
        li.stop()
