"""End to end, property-based: producer caches → real ZeroMQ → subscriber → index, with batches lost
on the wire (inside and beyond the replay buffer) and publisher restarts. Whatever the history,
once the stream settles the index holds exactly the (block, tier) pairs every cache holds with
acknowledged bytes."""
from __future__ import annotations

import time

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from support.net import free_port
from indexer.index import KVIndex
from indexer.deliveries import Batch, Gap, Restart
from indexer.subscriber import Subscriber
from sim.driver import Driver, StreamSpec, build_cache, synthetic_stream
from producer.events import EventRecorder
from producer.publisher import ZmqEventPublisher
from producer.sinks import ZmqSink
from schemas.codec import decode_batch
from schemas.events import AllBlocksCleared, KVEventBatch

MODEL, PAGE, MASK = "m", 4, (1 << 64) - 1
REQUESTS = list(synthetic_stream(StreamSpec(requests=60, prefixes=5, prefix_tokens=32, suffix_tokens=8, seed=11)))


class Producer:
    """One worker process: cache + publisher on fixed endpoints (a restart rebinds them)."""

    def __init__(self, wid: str, buffer_steps: int) -> None:
        self.wid = wid
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        self.buffer_steps = buffer_steps
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        self.pub = ZmqEventPublisher(self.endpoint, replay_endpoint=self.replay, buffer_steps=self.buffer_steps)
        self.cache = build_cache(page_size=PAGE, device_pages=24, host_pages=48, transfer="thread",
                                 recorder=EventRecorder(ZmqSink(self.pub), heartbeat_interval_s=3600.0))
        self.driver = Driver(self.cache, lookahead=0)

    def stop(self) -> None:
        self.cache.transfer.close()
        self.pub.close()

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self._start()

    def serve(self, i: int) -> None:
        self.driver.serve(REQUESTS[i % len(REQUESTS)])
        self.cache.wait_transfers(10.0)
        self.cache.step()

    def truth(self) -> set[tuple[int, str]]:
        return {(i & MASK, m.name) for i, m in self.cache.resident_blocks()}


class Router:
    """The consumer side: what the indexer service does with deliveries, minus HTTP."""

    def __init__(self, producers: dict[str, Producer], lost: set[tuple[str, int]]) -> None:
        self.index = KVIndex()
        self.index.ensure_model(MODEL, PAGE)
        self.sub = Subscriber(replay_timeout=1.0, drop_live=lambda w, s: (w, s) in lost and not lost.discard((w, s)))
        self.applied: dict[str, int] = {}
        self.awaiting_snapshot: set[str] = set()
        self.restarts_seen: dict[str, int] = {w: 0 for w in producers}
        for p in producers.values():
            self.index.register_worker(MODEL, p.wid, 0)
            self.sub.add(p.wid, p.endpoint, p.replay)

    def pump(self, timeout_ms: int = 10) -> None:
        for d in self.sub.poll(timeout_ms):
            if isinstance(d, Batch):
                batch = decode_batch(d.payload)
                if isinstance(batch, KVEventBatch) and batch.events and isinstance(batch.events[0], AllBlocksCleared):
                    self.awaiting_snapshot.discard(d.worker_id)
                self.index.apply_payload(MODEL, d.worker_id, 0, d.payload)
                self.applied[d.worker_id] = d.seq
            elif isinstance(d, Gap) and not d.recovered:
                self.index.clear_worker(MODEL, d.worker_id)
                if self.sub.request_snapshot(d.worker_id):
                    self.awaiting_snapshot.add(d.worker_id)
            elif isinstance(d, Restart):
                self.restarts_seen[d.worker_id] += 1
                self.index.clear_worker(MODEL, d.worker_id)

    def view(self, wid: str) -> set[tuple[int, str]]:
        return {(h, e.medium) for w, _r, evs in self.index.dump(MODEL) if w == wid for e in evs for h in e.block_hashes}


def settle(router: Router, producers: dict[str, Producer], timeout: float = 20.0) -> None:
    """Until every batch each publisher sent is applied and every requested snapshot has arrived.
    Producers keep stepping (a snapshot request is answered at the next step) and heartbeating
    (a subscriber learns of a lost tail only from the next live batch)."""
    deadline = time.monotonic() + timeout
    while True:
        for p in producers.values():
            p.cache.step()
            p.pub.flush(5.0)
        router.pump(20)
        behind = [p.wid for p in producers.values() if router.applied.get(p.wid, -1) < p.pub.next_seq - 1]
        if not behind and not router.awaiting_snapshot:
            return
        assert time.monotonic() < deadline, f"not settled: behind={behind} snapshots={router.awaiting_snapshot}"
        for wid in behind or router.awaiting_snapshot:
            producers[wid].pub.heartbeat()


def reconnect_after_restart(router: Router, p: Producer, seen_before: int) -> None:
    """A restarted publisher's first batches go nowhere until the SUB reconnects; heartbeat slowly
    until the subscriber has noticed the restart (seq went back toward 0)."""
    deadline = time.monotonic() + 15.0
    while router.restarts_seen[p.wid] == seen_before:
        assert time.monotonic() < deadline, "restart never observed"
        p.pub.heartbeat()
        router.pump(150)


serve = st.tuples(st.just("serve"), st.sampled_from(["a", "b"]), st.integers(0, 59))
ops = st.lists(
    st.one_of(
        serve, serve, serve,
        st.tuples(st.just("lose"), st.sampled_from(["a", "b"]), st.integers(1, 8)),
        st.tuples(st.just("restart"), st.sampled_from(["a", "b"]), st.just(0)),
    ),
    min_size=10, max_size=40,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=ops, buffer_steps=st.integers(2, 12))
def test_index_equals_producers_after_losses_and_restarts(history: list, buffer_steps: int) -> None:
    producers = {w: Producer(w, buffer_steps) for w in ("a", "b")}
    lost: set[tuple[str, int]] = set()
    router = Router(producers, lost)
    try:
        settle(router, producers)  # subscriptions up
        for op, wid, arg in history:
            p = producers[wid]
            if op == "serve":
                p.serve(arg)
            elif op == "lose":  # the next `arg` batches of this worker vanish on the wire
                p.pub.flush(5.0)
                lost.update((wid, s) for s in range(p.pub.next_seq, p.pub.next_seq + arg))
            elif op == "restart" and p.pub.next_seq >= 8:  # room for the SUB to reconnect (see README)
                lost.difference_update({x for x in lost if x[0] == wid})  # those seqs were never sent
                settle(router, producers)
                seen = router.restarts_seen[wid]
                p.restart()
                reconnect_after_restart(router, p, seen)
            router.pump(0)
        lost.clear()  # losses only happen during the history; settling must then repair everything
        settle(router, producers)
        event(f"snapshots requested: {router.sub.stats.snapshot_requests > 0}")
        event(f"restarts: {sum(p.restarts for p in producers.values()) > 0}")
        event(f"gaps replayed: {router.sub.stats.gaps > router.sub.stats.gaps_unrecovered}")
        for p in producers.values():
            assert router.view(p.wid) == p.truth(), p.wid
    finally:
        router.sub.close()
        for p in producers.values():
            p.stop()
