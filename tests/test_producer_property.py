"""Property test of the tiered cache: random request streams, copies acknowledged in random order,
capacity pressure on every tier, L3 backup and prefetch.

After every operation: replaying the events emitted so far gives exactly the (block, tier) set the
cache holds with acknowledged bytes; every claimed page really holds its content (copies land only
when the test acks them, so a store announced early would show stale bytes); page ownership is
exact. At the end the L3 store really holds every block the events claim for it.
"""
from __future__ import annotations

import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.driver import Driver, build_cache, page_matches, page_pattern
from producer.events import EventRecorder
from producer.sinks import ListSink
from producer.storage import FileStorageBackend, StorageWorker
from producer.transfer import ManualTransferEngine
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from schemas.media import Medium, parse_medium


def replay(events: list) -> set[tuple[int, Medium]]:
    state: set[tuple[int, Medium]] = set()
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            state.clear()
            continue
        medium = parse_medium(ev.medium)
        assert medium is not None, f"unknown medium {ev.medium!r}"
        if isinstance(ev, BlockStored):
            assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
            for h in ev.block_hashes:
                assert (h, medium) not in state, f"duplicate store of {(h, medium)}"
                state.add((h, medium))
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                assert (h, medium) in state, f"remove of a block never stored: {(h, medium)}"
                state.discard((h, medium))
    return state


def check_bytes(cache) -> None:
    """Every page the cache claims (device/host, acknowledged) holds its content's bytes."""
    for node in cache.tree.nodes():
        if node.hollow:
            continue
        digests = cache.tree.digest_list(node)
        if node.value is not None and node.device_ready:
            for page, d in zip(node.value, digests):
                assert page_matches(cache.device, page, d), f"device page {page} of {node!r} wrong"
        if node.host_value is not None and node.host_ready:
            for page, d in zip(node.host_value, digests):
                assert page_matches(cache.host, page, d), f"host page {page} of {node!r} wrong"


class SettledStorageWorker(StorageWorker):
    """The real worker thread and backend, but every poll first waits until the operations submitted
    so far have finished: what the cache sees then depends on the program alone, not on thread timing,
    so hypothesis can replay and shrink an example (acks of device/host copies stay test-controlled)."""

    def drain_evicted(self) -> list[str]:
        assert self.wait_idle(5.0), "storage worker stuck"
        return super().drain_evicted()

    def poll(self):  # noqa: ANN201
        assert self.wait_idle(5.0), "storage worker stuck"
        return super().poll()


# (kind, a, b, c); the kind list is weighted toward requests and acks by repetition
ops = st.tuples(
    st.sampled_from(["req"] * 6 + ["ack"] * 3 + ["step", "time", "evict_host", "reset"]),
    st.integers(0, 6), st.integers(4, 24), st.integers(1, 8),
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    data=st.data(),
    page_size=st.sampled_from([1, 2, 4]),
    policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
    device_pages=st.integers(6, 20),
    host_pages=st.integers(4, 24),
    l3_pages=st.sampled_from([0, 6, 64]),
    prefixes=st.lists(st.lists(st.integers(1, 6), min_size=4, max_size=20), min_size=1, max_size=4),
    program=st.lists(ops, min_size=20, max_size=60),
)
def test_events_replay_to_acknowledged_residency(data, page_size, policy, device_pages, host_pages, l3_pages,
                                                  prefixes, program) -> None:
    sink = ListSink()
    engine = ManualTransferEngine()
    now = [0.0]
    with tempfile.TemporaryDirectory() as root:
        worker = None
        if l3_pages:
            page_bytes = page_size * 2 * 8 * 4  # build_cache: page (page_size, 2, 8) float32
            worker = SettledStorageWorker(FileStorageBackend(root, capacity_bytes=l3_pages * page_bytes))
        try:
            cache = build_cache(page_size=page_size, device_pages=device_pages, host_pages=host_pages,
                                transfer=engine, storage=worker, recorder=EventRecorder(sink),
                                write_policy=policy, write_through_threshold=2,
                                prefetch_threshold_tokens=page_size, prefetch_timeout_base_s=1.0)
            cache.clock = lambda: now[0]

            def land_some(k: int | None = None) -> None:
                pending = engine.pending_ids()
                if not pending:
                    return
                order = data.draw(st.permutations(pending), label="ack order")
                engine.complete(order[:len(order) if k is None else k])

            driver = Driver(cache, pump=land_some, lookahead=1)

            def check() -> None:
                if worker is not None:
                    worker.wait_idle(5.0)  # results become visible to step() deterministically
                cache.step(now[0])
                assert replay(sink.events()) == cache.resident_blocks()
                check_bytes(cache)
                assert cache.audit() == []

            resets = 0
            for op in program:
                kind = op[0]
                if kind == "req":
                    _, which, cut, extra = op
                    base = prefixes[which % len(prefixes)]
                    tokens = base[:cut] + [7 + (i % 3) for i in range(extra)]
                    tokens = tokens[:(device_pages - 2) * page_size]  # must fit the device at all
                    if tokens:
                        driver.submit(tokens)
                elif kind == "ack":
                    land_some(op[1])
                elif kind == "time":
                    now[0] += 5.0 if op[1] == 0 else 0.1  # 5 s outlives any prefetch deadline
                elif kind == "evict_host":
                    cache.evict_host(op[1])
                elif kind == "reset":
                    resets += 1
                    if resets % 4 == 0:  # rare: a reset wipes the interesting state
                        cache.reset()
                check()
            driver.drain()
            engine.complete()
            check()
            if worker is not None:
                # the store really holds what the events claim for L3
                worker.wait_idle(5.0)
                cache.step(now[0])
                backend = worker.backend
                claimed = {bid for bid, m in replay(sink.events()) if m is Medium.DISK}
                for node in cache.tree.nodes():
                    if node.stored:
                        keys = cache._l3_keys(node)
                        values = backend.get(keys)
                        for d, v in zip(cache.tree.digest_list(node), values):
                            assert v is not None and v == bytes(page_pattern(d, cache.host.page_bytes).numpy())
                        claimed.difference_update(cache.tree.ensure_hashes(node))
                assert claimed == set()
        finally:
            if worker is not None:
                worker.close()
