"""The simulated worker's hybrid families (`kvatlas worker --family`): what it keeps of each request
(Mamba states at chunk ends, the window's pages at the prompt's end) and the tokens it reports
served from cache — the family's usable prefix, never the full-attention run alone."""
from __future__ import annotations

import time

import pytest

from producer.components.families import FamilySizes, build_family_cache
from producer.events import EventRecorder
from producer.sim.api import SimModel
from producer.sim.driver import Driver
from producer.sim.engine import Engine
from producer.sim.hybrid import mamba_ends
from producer.sinks import ListSink
from schemas.events import BlockStored

P = 16                      # tokens per page
CHUNK = 4                   # pages per Mamba chunk
WINDOW = 2 * P              # sliding window: cdiv(31, 16) = 2 pages before a match end


def _cache(family: str, host_pages: int = 0, sink: ListSink | None = None):  # noqa: ANN202
    sizes = FamilySizes(page_size=P, device_pages=128, host_pages=host_pages, kv_shape=(2,), mamba_states=32,
                        host_mamba_states=32, conv_shape=(2,), temporal_shape=(2,), window=WINDOW, swa_shape=(2,),
                        dsa_shape=(2,))
    return build_family_cache(family, sizes, device="cpu", transfer="thread" if host_pages else None,
                              recorder=EventRecorder(sink) if sink is not None else None, component_events=True)


def _tokens(base: int, pages: int, tail: int = 3) -> list[int]:
    return [base + i for i in range(pages * P + tail)]


def _serve(family: str, prompts: list[list[int]]) -> list[tuple[int, int, int]]:
    """(arrival_cached, served from cache, computed) per prompt, served in order by the engine."""
    engine = Engine(_cache(family), SimModel(), chunk_pages=CHUNK)
    try:
        out = []
        for i, t in enumerate(prompts):
            s = engine.submit(t, 4, float(i)).result(30)
            out.append((s.arrival_cached, s.tokens.cached, s.tokens.computed))
            assert s.tokens.cached + s.tokens.computed == len(t)
        return out
    finally:
        engine.close()


A = _tokens(1000, 20)                      # 20 full pages + 3 tokens
SHARED10 = A[:10 * P] + _tokens(9000, 3)   # shares A's first 10 pages, then diverges
LONGER = A[:20 * P] + _tokens(7000, 2)     # the next turn: A's 20 pages and more


@pytest.mark.parametrize("family, shared10, longer", [
    ("full", 10, 20),
    ("dsa", 10, 20),     # DSA's indexer keys ride on the KV pages: the KV rule
    ("mamba", 8, 20),    # states at chunk ends 4, 8, 12, 16 and the prompt's end 20: resume from 8
    ("swa", 0, 20),      # the window's pages are kept at A's end only (pages 18-19)
])
def test_served_from_cache_is_the_family_usable_prefix(family: str, shared10: int, longer: int) -> None:
    res = _serve(family, [A, SHARED10, LONGER])
    assert res[0] == (0, 0, len(A))
    # what the worker held at arrival and what it served agree, and both are the usable prefix
    assert res[1][:2] == (shared10 * P, shared10 * P), res
    assert res[2][:2] == (longer * P, longer * P), res


def test_the_full_attention_match_promises_more_than_a_hybrid_can_use() -> None:
    """The KV run a group-blind index sees (match.kv_len) against the usable prefix (best_len)."""
    for family, usable in (("mamba", 8), ("swa", 0)):
        cache = _cache(family)
        Driver(cache, lookahead=0, chunk_pages=CHUNK).run([A])
        m = cache.match_prefix(SHARED10)
        assert (m.kv_len, m.best_len) == (10 * P, usable * P), family


def test_hybrid_workers_publish_group_events() -> None:
    """component events on: a Mamba store per kept state, a window store for the window's pages."""
    for family, kind, blocks in (("mamba", "mamba", [4, 8, 12, 16, 20]), ("swa", "sliding_window", [19, 20])):
        sink = ListSink()
        cache = _cache(family, sink=sink)
        Driver(cache, lookahead=0, chunk_pages=CHUNK).run([A])
        cache.step()
        evs = [e for e in sink.events() if isinstance(e, BlockStored)]
        stored = [e for e in evs if e.group_idx == 1]
        assert stored and all(e.kv_cache_spec_kind == kind for e in stored), family
        kv = [e for e in evs if e.group_idx == 0]
        order = [h for e in kv for h in e.block_hashes]
        got = sorted(order.index(h) + 1 for e in stored for h in e.block_hashes)
        assert got == blocks, (family, got)


def test_mamba_ends() -> None:
    assert mamba_ends(0, 10, 4) == [4, 8, 10]
    assert mamba_ends(3, 10, 4) == [7, 10]
    assert mamba_ends(0, 8, 4) == [4, 8]
    assert mamba_ends(5, 5, 4) == []
    with pytest.raises(ValueError):
        mamba_ends(0, 4, 0)


def test_hybrid_load_back_costs_the_state_and_the_window() -> None:
    sim = SimModel(mamba_state_bytes=25_000_000, window_bytes_per_token=1000)
    assert sim.load_bytes_s(25_000_000, "host") == pytest.approx(25e6 / sim.h2d_bytes_per_s)
    assert sim.load_bytes_s(4e9, "disk") == pytest.approx(4e9 / sim.h2d_bytes_per_s + 1.0)
    assert SimModel().mamba_state_bytes == 0 and SimModel().window_bytes_per_token == 0  # full attention unchanged


def test_pending_routes_on_a_hybrid_worker_count_to_where_a_route_ends() -> None:
    """An in-flight request on a hybrid worker leaves its prefix usable at its end only (for sure):
    a query sharing part of it gets no pending blocks, one extending it gets them all."""
    from producer.publisher import ZmqEventPublisher
    from producer.sinks import ZmqSink
    from router_api.embedded import EmbeddedIndexer
    from support.net import wait_until

    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    try:
        rec = EventRecorder(ZmqSink(pub), heartbeat_interval_s=0.2)
        sizes = FamilySizes(page_size=P, device_pages=128, kv_shape=(2,), mamba_states=32, conv_shape=(2,),
                            temporal_shape=(2,))
        cache = build_family_cache("mamba", sizes, device="cpu", recorder=rec, component_events=True)
        with EmbeddedIndexer(workers=[{"worker_id": "w0", "endpoint": pub.endpoint,
                                       "replay_endpoint": pub.replay_endpoint}], block_size=P,
                             pending_ttl_s=60.0) as idx:
            Driver(cache, lookahead=0, chunk_pages=CHUNK).run([A])  # states at 4, 8, 12, 16, 20

            def indexed() -> bool:
                cache.step(time.monotonic())  # heartbeats: a subscriber that joined late replays the gap
                return idx.score(A).workers[0].cached_blocks == 20

            wait_until(indexed, 60.0)
            row = idx.score(SHARED10).workers[0]
            assert (row.cached_blocks, row.kv_blocks) == (8, 10)
            longer = A + _tokens(5000, 10)            # 30 full pages, in flight (not served yet)
            assert idx.report_route(None, "r", "w0", longer) == 0
            part = longer[:25 * P] + _tokens(6000, 4)  # shares 25 of its 30 pages
            assert idx.score(part).workers[0].pending_blocks == 0
            assert idx.report_route(None, "r2", "w0", part) == 0  # the route's answer says the same
            assert idx.score(longer + [1, 2, 3] * P).workers[0].pending_blocks == 10
    finally:
        pub.close()


def test_load_back_of_a_hybrid_prefix_moves_its_state_or_window_too() -> None:
    """A prefix served from below the GPU also brings its Mamba state / its window's pages, from
    the deepest tier it used; a GPU-served one brings nothing more."""
    from producer.sim.api import Tokens

    sim = SimModel(mamba_state_bytes=64 << 20, window_bytes_per_token=1000)
    for family, nbytes in (("mamba", 64 << 20), ("swa", 2 * P * 1000), ("full", 0), ("dsa", 0)):
        engine = Engine(_cache(family), sim)
        try:
            assert engine._component_load_s(Tokens(gpu=10 * P, computed=5)) == 0.0
            host = engine._component_load_s(Tokens(gpu=P, host=4 * P, computed=5))
            disk = engine._component_load_s(Tokens(host=P, disk=4 * P, computed=5))
            assert host == pytest.approx(sim.load_bytes_s(nbytes, "host")), family
            assert disk == pytest.approx(sim.load_bytes_s(nbytes, "disk")), family
        finally:
            engine.close()
