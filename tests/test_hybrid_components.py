"""Hybrid components in the tiered cache: the scenarios engines need (docs/hybrid.md)."""
from __future__ import annotations

import pytest

from producer.components.families import FAMILIES, FamilySizes, build_family_cache
from producer.events import EventRecorder
from producer.sinks import ListSink
from producer.storage import MemoryStorageBackend, StorageWorker
from producer.transfer import ManualTransferEngine
from schemas.events import BlockRemoved, BlockStored
from support.hybrid_history import Settled
from support.hybrid_model import HybridModel

P = 4
A = list(range(100, 132))  # 8 pages


def make(family: str = "mamba", host: bool = True, events: bool = True, storage=None, **kw):
    sink = ListSink()
    eng = ManualTransferEngine()
    sizes = FamilySizes(page_size=P, device_pages=kw.pop("device_pages", 32), host_pages=64 if host else 0,
                        mamba_states=8, host_mamba_states=16, window=kw.pop("window", 9))
    cache = build_family_cache(family, sizes, transfer=eng if host else None, storage=storage,
                               recorder=EventRecorder(sink), component_events=events, **kw)
    return cache, eng, sink


def put(cache, tokens, states=(), swa=True):
    """The engine computed `tokens`: new KV pages (+ SWA pages, + Mamba states at `states` pages)."""
    n = len(tokens) // P
    m = cache.match_prefix(tokens)
    have = len(m.device_pages)
    pages = m.device_pages + cache.alloc_device(n - have)
    comp = {}
    for c in cache.components:
        if c.per_page and swa:
            comp[c.name] = [None] * have + cache.alloc_component(c.name, n - have)
        elif not c.per_page:
            comp[c.name] = {k: cache.alloc_component(c.name, 1)[0] for k in states}
    cache.insert(tokens, pages, component_pages=comp)
    cache.step(0.0)


def settle(cache, eng, t=0.0):
    eng.complete()
    cache.step(t)


def lens(m):
    return m.device_len // P, (m.device_len + m.host_len) // P, m.best_len // P


def test_families_build_and_host_memory_is_checked_for_all_pools() -> None:
    for f in FAMILIES:
        cache, _, _ = make(f)
        assert cache.audit() == []
    with pytest.raises(MemoryError, match=r"kv \d+ bytes, mamba \d+ bytes.*only 1000 bytes"):
        build_family_cache("mamba", FamilySizes(page_size=P, device_pages=4, host_pages=64),
                           transfer="manual", available_bytes=1000)
    with pytest.raises(ValueError, match="unknown model family"):
        build_family_cache("rwkv", FamilySizes(page_size=P, device_pages=4))


def test_mamba_host_backed_best_keeps_device_anchor_and_aux_only_load_back() -> None:
    cache, eng, sink = make("mamba")
    put(cache, A, states=[4, 8])
    settle(cache, eng)  # write-through: KV + states on the host
    assert lens(cache.match_prefix(A)) == (8, 8, 8)
    # Mamba-only eviction of the device state at page 8: the KV stays
    cache.match_prefix(A[:16])  # the state at page 8 is now the least recently used
    assert cache.evict_component("mamba", 1) == 1
    m = cache.match_prefix(A)
    assert lens(m) == (4, 8, 8)
    assert m.kv_len == 8 * P and m.device_len < m.best_len
    assert m.branch_len == 0  # the match relies on a host-backed state: no branching
    dev_state = cache.component_indices(m.device_node)["mamba"]
    pages, node = cache.init_load_back(m)
    assert node is m.host_node and len(pages) == 8  # KV was on the device: only the state loads
    assert cache.stats["load_back_pages"] == 0
    idx = cache.component_indices(node)["mamba"]
    assert len(idx) == 1 and idx != dev_state
    assert not any(isinstance(e, BlockStored) and e.group_idx == 1 and e.medium == "GPU"
                   for e in sink.events()[-1:])  # not before the ack
    settle(cache, eng, 0.1)
    assert lens(cache.match_prefix(A)) == (8, 8, 8)
    assert cache.audit() == []


def test_without_host_best_and_device_coincide_and_branching() -> None:
    cache, _, _ = make("mamba", host=False)
    put(cache, A, states=[4])
    m = cache.match_prefix(A)
    assert lens(m) == (4, 4, 4)
    assert m.kv_len == 8 * P and m.branch_len == 8 * P  # KV past the last state, all on device
    cache.evict_component("mamba", 8)
    m = cache.match_prefix(A)
    assert lens(m) == (0, 0, 0) and m.best_node is cache.tree.root
    assert cache.audit() == []


def test_swa_match_needs_the_window_and_loads_it_back() -> None:
    cache, eng, sink = make("swa", window=9)  # cdiv(8, 4) = 2 pages before the end
    put(cache, A[:16])
    put(cache, A)  # two nodes: pages [0,4) and [4,8)
    settle(cache, eng)
    assert lens(cache.match_prefix(A)) == (8, 8, 8)
    # tombstone the SWA pages of the older node: ends inside it still need its pages
    first = cache.match_prefix(A[:16]).device_node
    cache.match_prefix(A)  # the second node is the most recently used: the first is tombstoned
    cache.evict_component("swa", 4)
    m = cache.match_prefix(A)
    assert cache.component_indices(m.device_node)["swa"].count(None) >= 4
    d, h, b = lens(m)
    assert b == 8 and d == 8  # the window of the full match lies in the second node
    m4 = cache.match_prefix(A[:16])
    assert lens(m4)[0] < 4 and lens(m4)[2] == 4  # ending at 4 needs pages 2,3 (host only now)
    pages, node = cache.init_load_back(m4)
    assert cache.stats.get("load_back_pages", 0) == 0  # aux-only: SWA pages only
    settle(cache, eng, 0.1)
    assert lens(cache.match_prefix(A[:16])) == (4, 4, 4)
    assert first is not None and cache.audit() == []


def test_split_keeps_event_hashes_and_mamba_eviction_events() -> None:
    for opt_in in (False, True):
        cache, eng, sink = make("mamba", host=False, events=opt_in)
        put(cache, A, states=[8])
        stored_m = [e for e in sink.events() if isinstance(e, BlockStored) and e.group_idx == 1]
        put(cache, A[:8] + [7] * 8, states=[4])  # splits the first node after 2 pages
        n0 = len(sink.events())
        cache.evict_component("mamba", 8)
        cache.step(1.0)
        rem = [e for e in sink.events()[n0:] if isinstance(e, BlockRemoved)]
        if not opt_in:
            assert stored_m == [] and rem == []  # default: Mamba-only eviction is silent
            continue
        assert [e.kv_cache_spec_kind for e in stored_m] == ["mamba"]
        assert all(e.group_idx == 1 and e.medium == "GPU" for e in rem)
        removed = {h for e in rem for h in e.block_hashes}
        assert stored_m[0].block_hashes[0] in removed  # same hash across the split
        model = HybridModel(P)
        model.apply("w", sink.events())
        assert model.usable("w", A) == (0, 0)
        assert model.workers["w"].kv_blocks(A, P) == 8


class FailingBackend(MemoryStorageBackend):
    def __init__(self, fail_suffix: str) -> None:
        super().__init__()
        self.fail_suffix = fail_suffix

    def set(self, keys, values):  # noqa: ANN001, ANN201
        ok = super().set(keys, values)
        return [o and not k.endswith("." + self.fail_suffix) for k, o in zip(keys, ok)]


@pytest.mark.parametrize("family,suffix", [("dsa", "dsa"), ("mamba", "mamba")])
def test_l3_write_failing_for_one_pool_claims_nothing(family, suffix) -> None:
    w = Settled(FailingBackend(suffix))
    try:
        cache, eng, sink = make(family, storage=w, prefetch_threshold_tokens=P)
        put(cache, A, states=[8])
        settle(cache, eng)
        cache.step(0.1)
        assert not any(e.medium == "DISK" for e in sink.events() if isinstance(e, BlockStored))
        assert not any(n.stored for n in cache.tree.nodes())
        assert cache.stats["backup_failed_nodes"] >= 1
        assert cache.audit() == []
    finally:
        w.close()


def test_l3_round_trip_with_components_and_local_prefetch_sizing() -> None:
    w = Settled(MemoryStorageBackend())
    try:
        cache, eng, sink = make("mamba", storage=w, prefetch_threshold_tokens=P)
        # a local store holding nothing: no host pages reserved, nothing evicted
        assert not cache.prefetch(A) and cache.stats["prefetch_not_held"] == 1
        put(cache, A, states=[4, 8])
        settle(cache, eng)
        cache.step(0.1)
        model = HybridModel(P)
        model.apply("w", sink.events())
        assert model.usable("w", A) == (8, 8)
        cache.evict(64)
        cache.evict_host(64)
        cache.step(0.2)
        m = cache.match_prefix(A)
        assert lens(m) == (0, 0, 8)
        assert cache.prefetch(A, m, now=0.2)
        cache.step(0.3)
        m = cache.match_prefix(A)
        assert lens(m) == (0, 8, 8)
        cache.init_load_back(m)
        settle(cache, eng, 0.4)
        assert lens(cache.match_prefix(A)) == (8, 8, 8)
        model = HybridModel(P)
        model.apply("w", sink.events())
        assert model.usable("w", A) == (8, 8)
        assert cache.audit() == []
    finally:
        w.close()


class SlowBackend(MemoryStorageBackend):
    """Gets that name a key with `suffix` wait until released (a stalled component read)."""

    def __init__(self, suffix: str) -> None:
        super().__init__()
        import threading
        self.suffix = suffix
        self.release = threading.Event()

    def get(self, keys):  # noqa: ANN001, ANN201
        if any(k.endswith("." + self.suffix) for k in keys):
            self.release.wait(10.0)
        return super().get(keys)


def test_prefetch_timing_out_for_one_component_loads_nothing() -> None:
    backend = SlowBackend("dsa")
    w = StorageWorker(backend)
    try:
        cache, eng, sink = make("dsa", storage=w, prefetch_threshold_tokens=P, prefetch_timeout_base_s=0.5)
        put(cache, A)
        settle(cache, eng)
        assert w.wait_idle(5.0)
        cache.step(0.1)
        cache.evict(64)
        cache.evict_host(64)
        cache.step(0.2)
        n0 = len(sink.events())
        assert cache.prefetch(A, now=1.0)
        cache.step(5.0)  # past the deadline while the indexer-key read stalls
        assert cache.stats["prefetch_timeouts"] == 1
        backend.release.set()
        assert w.wait_idle(5.0)
        cache.step(5.1)
        assert not any(isinstance(e, BlockStored) and e.medium == "CPU_PINNED" for e in sink.events()[n0:])
        assert lens(cache.match_prefix(A))[1] == 0
        assert cache.audit() == []
    finally:
        backend.release.set()
        w.close()
