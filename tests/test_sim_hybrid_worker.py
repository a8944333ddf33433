"""The simulated worker's hybrid families (`kvatlas worker --family`): what it keeps of each request
(Mamba states at chunk ends and at a branching point; the window KV of every completed prefill chunk
and of the prompt's end), its component pools with their own LRU, and the tokens it reports served
from cache — the family's usable prefix, never the full-attention run alone."""
from __future__ import annotations

import time

import pytest

from producer.components.families import FamilySizes, build_family_cache
from producer.events import EventRecorder
from sim.api import SimModel
from sim.driver import Driver
from sim.engine import Engine
from sim.hybrid import mamba_ends, swa_pages
from producer.sinks import ListSink
from schemas.events import BlockStored

P = 16                      # tokens per page
CHUNK = 4                   # pages per Mamba chunk
WINDOW = 2 * P              # sliding window: cdiv(31, 16) = 2 pages before a match end


def _cache(family: str, host_pages: int = 0, sink: ListSink | None = None, swa_pages_: int = 0):  # noqa: ANN202
    sizes = FamilySizes(page_size=P, device_pages=128, host_pages=host_pages, kv_shape=(2,), mamba_states=32,
                        host_mamba_states=32, conv_shape=(2,), temporal_shape=(2,), window=WINDOW, swa_shape=(2,),
                        dsa_shape=(2,), swa_device_pages=swa_pages_)
    return build_family_cache(family, sizes, device="cpu", transfer="thread" if host_pages else None,
                              recorder=EventRecorder(sink) if sink is not None else None, component_events=True)


def _tokens(base: int, pages: int, tail: int = 3) -> list[int]:
    return [base + i for i in range(pages * P + tail)]


def _serve(family: str, prompts: list[list[int]], cache=None, between=None) -> list[tuple[int, int, int]]:  # noqa: ANN001
    """(arrival_cached, served from cache, computed) per prompt, served in order by the engine.
    With `between(cache, i)` (run before prompt i) the engine's thread is stopped first and the
    requests are served from this thread, the cache's only user then."""
    engine = Engine(cache or _cache(family), SimModel(), chunk_pages=CHUNK)
    try:
        if between is not None:
            engine.close()
        out = []
        for i, t in enumerate(prompts):
            if between is None:
                s = engine.submit(t, 4, float(i)).result(30)
            else:
                between(engine.cache, i)
                s = engine._serve(t, 4, float(i))
            out.append((s.arrival_cached, s.tokens.cached, s.tokens.computed))
            assert s.tokens.cached + s.tokens.computed == len(t)
        return out
    finally:
        engine.close()


A = _tokens(1000, 20)                      # 20 full pages + 3 tokens
SHARED10 = A[:10 * P] + _tokens(9000, 3)   # shares A's first 10 pages, then diverges
SHARED17 = A[:17 * P] + _tokens(8000, 3)   # shares 17: page 16 is in A's last chunk, out of its window
LONGER = A[:20 * P] + _tokens(7000, 2)     # the next turn: A's 20 pages and more


@pytest.mark.parametrize("family, shared10, shared17, longer", [
    ("full", 10, 17, 20),
    ("dsa", 10, 17, 20),    # DSA's indexer keys ride on the KV pages: the KV rule
    ("mamba", 8, 16, 20),   # states at chunk ends 4, 8, 12, 16 and the prompt's end 20
    ("swa", 10, 16, 20),    # window KV of pages 0-15 (completed chunks) and 18-19 (the prompt's end)
])
def test_served_from_cache_is_the_family_usable_prefix(family: str, shared10: int, shared17: int,
                                                       longer: int) -> None:
    for shared, n in ((SHARED10, shared10), (SHARED17, shared17)):
        res = _serve(family, [A, shared, LONGER])
        assert res[0] == (0, 0, len(A))
        # what the worker held at arrival and what it served agree, and both are the usable prefix
        assert res[1][:2] == (n * P, n * P), (family, res)
        assert res[2][:2] == (longer * P, longer * P), (family, res)


def test_the_full_attention_match_promises_more_than_a_hybrid_can_use() -> None:
    """The KV run a group-blind index sees (match.kv_len) against the usable prefix (best_len)."""
    for family, prompt, kv, usable in (("mamba", SHARED10, 10, 8), ("swa", SHARED17, 17, 16)):
        cache = _cache(family)
        Driver(cache, lookahead=0, chunk_pages=CHUNK).run([A])
        m = cache.match_prefix(prompt)
        assert (m.kv_len, m.best_len) == (kv * P, usable * P), family


def test_mamba_branching_keeps_a_state_where_the_shared_run_ends() -> None:
    """SGLang's Mamba branching: a request whose full-attention match runs past its last usable state
    recomputes from that state and keeps one at the end of the run, so the next request sharing the
    run resumes from there."""
    other = A[:10 * P] + _tokens(9500, 3)
    res = _serve("mamba", [A, SHARED10, other])
    assert [r[1] for r in res] == [0, 8 * P, 10 * P], res


def test_swa_branching_keeps_the_window_where_the_shared_run_ends() -> None:
    """SGLang's SWA branching (swa_branching_seqlen): A's page 16 lies in its last chunk, out of the
    window kept at its end, so SHARED17 resumes from 16; recomputing, the engine keeps the window at
    the end of the shared run (pages 15-16), so the next prompt sharing those 17 pages resumes from 17."""
    other = A[:17 * P] + _tokens(9500, 3)
    res = _serve("swa", [A, SHARED17, other])
    assert [r[1] for r in res] == [0, 16 * P, 17 * P], res


def test_a_kv_hit_past_the_usable_prefix_is_recomputed() -> None:
    """Component state tombstoned by its own pool's LRU while the KV stays: the engine serves only the
    usable prefix (here nothing: every state and window page is gone), recomputes the rest, and keeps
    new state, so the same prompt is then served whole."""
    for family, name in (("mamba", "mamba"), ("swa", "swa")):
        def drop(cache, i: int, name: str = name) -> None:  # noqa: ANN001
            if i == 1:
                cache.evict_component(name, 1 << 20)
                assert cache.match_prefix(LONGER).kv_len == 20 * P  # the KV is all there

        res = _serve(family, [A, LONGER, LONGER], between=drop)
        assert res[1] == (0, 0, len(LONGER)), (family, res)
        assert res[2][1] == len(LONGER) // P * P, (family, res)


def test_a_small_window_pool_tombstones_the_oldest_window_pages() -> None:
    """The window KV has its own bounded pool with its own LRU: a second prompt needing more window
    pages than are free tombstones the least recently used ones (A's first 16 pages, one node) while
    every KV page stays, so a prompt branching inside them gets nothing usable and A's next turn,
    whose window (pages 18-19) survived, gets all of A."""
    b = _tokens(50_000, 12)                     # 10 window pages: chunk 0-7 and its window 10-11
    for prompt, served in ((SHARED10, 0), (LONGER, 20 * P)):
        cache = _cache("swa", swa_pages_=24)    # A keeps 18 window pages, 6 stay free
        res = _serve("swa", [A, b, prompt], cache=cache)
        assert res[2][1] == served, (res, cache.stats)
        assert cache.stats["swa_tombstoned_slots"] >= 16


def test_swa_pages() -> None:
    # completed chunks from where the computation started, then the window at the prompt's end
    assert swa_pages(0, 20, 4, 2) == [*range(16), 18, 19]
    assert swa_pages(10, 20, 4, 2) == list(range(10, 20))   # chunk ends 14, 18: the last chunk is 18-19
    assert swa_pages(0, 3, 4, 2) == [1, 2]                  # one chunk: the window alone
    assert swa_pages(5, 5, 4, 2) == []
    # a branching point at 17 (inside the last chunk 16-19): its window 15-16 too
    assert swa_pages(16, 20, 4, 2, branch=17) == [16, 18, 19]
    assert swa_pages(10, 20, 4, 2, branch=17) == [*range(10, 20)]
    assert swa_pages(0, 22, 8, 2, branch=17) == [*range(17), 20, 21]
    assert swa_pages(0, 20, 4, 2, branch=20) == swa_pages(0, 20, 4, 2)   # not inside the prompt: none


def test_worker_pool_defaults_follow_sglang() -> None:
    """`kvatlas worker` sizes the component pools as SGLang does unless told: Mamba states at
    mamba_full_memory_ratio 0.9 of the KV bytes for Qwen3-Next-80B, window pages at 0.8 of the KV,
    3/5 of the GPU state pool held by a full batch of running requests."""
    import argparse

    from sim.cmd import MAMBA_TOKENS_PER_STATE, add_arguments, pool_sizes

    p = argparse.ArgumentParser()
    add_arguments(p)
    got = pool_sizes(p.parse_args(["--block-size", "512", "--gpu-pages", "320", "--host-pages", "960"]))
    assert MAMBA_TOKENS_PER_STATE == 3493
    assert got == {"mamba_states": 46, "host_mamba_states": 140, "swa_device_pages": 256, "swa_host_pages": 768}
    got = pool_sizes(p.parse_args(["--mamba-states", "7", "--swa-pages", "9"]))
    assert (got["mamba_states"], got["swa_device_pages"]) == (7, 9)
    # SGLang: 3 slots per running request, at most pool // 5 of them running
    assert p.parse_args([]).running_state_share == pytest.approx(3 / 5)
    from sim.cmd import run

    assert run(p.parse_args(["--family", "mamba", "--running-state-share", "1"])) == 2  # refused before starting
    with pytest.raises(ValueError):
        Engine(_cache("mamba"), SimModel(), running_state_share=-0.1)


def test_hybrid_workers_publish_group_events() -> None:
    """component events on: a Mamba store per kept state, a window store per kept window page."""
    for family, kind, blocks in (("mamba", "mamba", [4, 8, 12, 16, 20]),
                                 ("swa", "sliding_window", [*range(1, 17), 19, 20])):
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
    """A prefix whose end is not usable on the GPU alone also brings its Mamba state / its window's
    pages, from the deepest tier they came from; one usable on the GPU brings nothing more."""
    sim = SimModel(mamba_state_bytes=64 << 20, window_bytes_per_token=1000)
    for family, nbytes in (("mamba", 64 << 20), ("swa", 2 * P * 1000), ("full", 0), ("dsa", 0)):
        engine = Engine(_cache(family), sim)
        try:
            assert engine._component_load_s("host", 0) == 0.0
            host = engine._component_load_s("host", 4 * P)
            disk = engine._component_load_s("disk", 4 * P)
            assert host == pytest.approx(sim.load_bytes_s(nbytes, "host")), family
            assert disk == pytest.approx(sim.load_bytes_s(nbytes, "disk")), family
        finally:
            engine.close()


@pytest.mark.parametrize("family, name", [("mamba", "mamba"), ("swa", "swa")])
def test_components_left_only_in_l3_are_fetched_back_under_kv_the_worker_still_holds(
        family: str, name: str, tmp_path) -> None:  # noqa: ANN001
    """Both faster pools tombstoned A's Mamba states / window pages while its KV stayed on the GPU and
    the host; L3 still holds them, so A is usable through L3. The engine fetches the components alone
    (the KV pages that come with them are dropped: the host holds that KV) and serves what it held at
    arrival, costing the components' load from L3 alone; then the prompt is usable on the GPU again."""
    from producer.storage import FileStorageBackend, StorageWorker

    w = StorageWorker(FileStorageBackend(tmp_path / "l3"))
    sizes = FamilySizes(page_size=P, device_pages=128, host_pages=128, kv_shape=(2,), mamba_states=32,
                        host_mamba_states=32, conv_shape=(2,), temporal_shape=(2,), window=WINDOW,
                        swa_shape=(2,))
    sink = ListSink()
    cache = build_family_cache(family, sizes, device="cpu", transfer="thread", storage=w,
                               recorder=EventRecorder(sink), component_events=True, prefetch_threshold_tokens=P)
    engine = Engine(cache, SimModel(mamba_state_bytes=1 << 20, window_bytes_per_token=1000), chunk_pages=CHUNK)
    try:
        engine.close()  # served from this thread
        engine._serve(A, 4, 0.0)
        for _ in range(3):  # the host copies and the L3 backups land
            cache.wait_transfers(5.0)
            cache.step()
            assert w.wait_idle(5.0)
            cache.step()
        cache.evict_component(name, 1 << 20, "device")
        cache.evict_component(name, 1 << 20, "host")
        cache.step()
        n0 = len(sink.events())
        m = cache.match_prefix(LONGER)
        assert (m.device_len, m.host_len, m.kv_len, m.best_len) == (0, 0, 20 * P, 20 * P)
        s = engine._serve(LONGER, 4, 1.0)
        assert (s.arrival_cached, s.tokens.cached) == (20 * P, 20 * P), cache.stats
        # the KV never left the GPU; only the components came from L3, and only they cost a load
        assert (s.tokens.gpu, s.tokens.disk) == (20 * P, 0)
        assert s.load_s == pytest.approx(engine._component_load_s("disk", 20 * P)) and s.load_s > 0
        assert cache.stats.get("prefetch_no_component_memory", 0) == 0
        cache.wait_transfers(5.0)
        cache.step()
        assert cache.match_prefix(LONGER).device_len >= 20 * P
        assert cache.audit() == []
        # the index hears the components come back (host, then GPU); A's KV, never gone, is not
        # re-announced (the group-0 stores name LONGER's two new pages only)
        a_kv = {h for e in sink.events()[:n0] if isinstance(e, BlockStored) and e.group_idx == 0
                for h in e.block_hashes}
        back = [e for e in sink.events()[n0:] if isinstance(e, BlockStored)]
        assert {e.medium for e in back if e.group_idx == 1} >= {"CPU_PINNED", "GPU"}, back
        assert not any(set(e.block_hashes) & a_kv for e in back if e.group_idx == 0), back
    finally:
        cache.transfer.close()
        w.close()


def test_running_requests_hold_their_share_of_the_state_pool() -> None:
    """SGLang's running requests take their working Mamba states from the pool the cache keeps its
    states in: with share 1/2 of a 32-state pool and 4 requests running (a full batch), 16 slots are
    held and the cache's least recently used states make room (tombstoned, their KV stays); once
    nothing runs the hold is given back."""
    cache = _cache("mamba")                                  # 32 GPU states, no host tier
    engine = Engine(cache, SimModel(max_batch=4), chunk_pages=CHUNK, running_state_share=0.5)
    try:
        engine.close()  # served from this thread
        first = _tokens(10_000, 20)
        for i in range(4):                                   # 5 states each (pages 4, 8, 12, 16, 20)
            engine._serve(_tokens(10_000 * (i + 1), 20), 1000, 0.001 * i)  # 20 s of decode: still running
        engine._serve(_tokens(90_000, 20), 4, 1.0)           # arrives while all 4 run
        assert len(engine._held) == 16
        pool = cache.components[0].device.allocator
        cached = sum(1 for n in cache.tree.nodes() if n.components and n.components["mamba"].dev is not None)
        assert (pool.available, cached) == (0, 16)
        # 25 states kept for 5 prompts, 16 of the 32 slots held: 9 least recently used states went
        assert cache.stats["mamba_tombstoned_slots"] == 9
        m = cache.match_prefix(first + [1])
        assert m.kv_len == 20 * P and m.best_len < 20 * P    # the KV stayed, its states did not
        engine._serve(_tokens(95_000, 4), 4, 100.0)          # every request has finished
        assert engine._held == [] and cache.components[0].device.allocator.available > 0
    finally:
        engine.close()
