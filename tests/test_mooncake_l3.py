"""The tiered cache on a real Mooncake Store (a `mooncake_master` per test): backups announced as
the shared medium (EXTERNAL) only once the store confirmed them, per-pool keys of hybrid nodes
(Mamba, DSA) round-tripping, a node partly in the store read as absent, worker B loading back what
worker A backed up, the index crediting the shared tier to every worker of the model, and the
failures — the master killed mid-backup, keys dropped behind the workers' backs."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from indexer.index import KVIndex
from producer.components.families import FamilySizes, build_family_cache
from producer.events import EventRecorder
from producer.page_hash import chain_digests, page_ids
from sim.driver import build_cache, compute_and_insert, page_matches, write_pattern
from producer.sinks import ListSink
from producer.storage import StorageWorker, make_storage_backend
from producer.storage.keys import page_key
from producer.storage.mooncake_backend import MooncakeStorageBackend
from producer.transfer import ManualTransferEngine
from schemas.events import BlockRemoved, BlockStored, KVEventBatch
from schemas.media import Medium, parse_medium
from support.hybrid_model import HybridModel
from support.mooncake import MooncakeMaster, drop_behind_back, mooncake_master  # noqa: F401
from support.net import wait_until

P = 4
TOKENS = list(range(1, 17))  # 4 pages
IDS = page_ids(TOKENS, P)


class Settled(StorageWorker):
    """A storage worker whose results are all in before the cache looks (deterministic steps)."""

    def drain_evicted(self) -> list[str]:
        assert self.wait_idle(30.0)
        return super().drain_evicted()

    def poll(self):  # noqa: ANN201
        assert self.wait_idle(30.0)
        return super().poll()


def mc(master: MooncakeMaster, **kw: object) -> MooncakeStorageBackend:
    be = make_storage_backend("mooncake", master.backend_config(**kw))
    assert isinstance(be, MooncakeStorageBackend)
    return be


@pytest.fixture
def workers(mooncake_master: MooncakeMaster) -> Iterator[list[Settled]]:
    made: list[Settled] = []
    yield made
    for w in made:
        w.close()
        w.backend.close()


def worker(made: list[Settled], master: MooncakeMaster, **kw: object) -> Settled:
    w = Settled(mc(master, **kw))
    made.append(w)
    return w


def full_cache(w: StorageWorker, **kw):
    sink = ListSink()
    engine = ManualTransferEngine()
    cache = build_cache(page_size=P, device_pages=16, host_pages=16, transfer=engine, storage=w,
                        recorder=EventRecorder(sink), prefetch_threshold_tokens=P, **kw)
    return cache, engine, sink




def settle(cache, engine, now: float = 0.0) -> None:
    for _ in range(3):  # a landed copy starts a backup, whose result lands on the next step
        engine.complete()
        cache.step(now)


def stored(sink, medium: Medium) -> list[int]:
    return [h for e in sink.events() if isinstance(e, BlockStored) and parse_medium(e.medium) is medium
            for h in e.block_hashes]


def removed(sink, medium: Medium) -> list[int]:
    return [h for e in sink.events() if isinstance(e, BlockRemoved) and parse_medium(e.medium) is medium
            for h in e.block_hashes]


def test_backup_is_external_and_worker_b_loads_back_what_a_backed_up(mooncake_master, workers) -> None:
    wa, wb = worker(workers, mooncake_master), worker(workers, mooncake_master)
    a, ea, sa = full_cache(wa)
    b, eb, sb = full_cache(wb)
    compute_and_insert(a, TOKENS)
    settle(a, ea)
    assert stored(sa, Medium.EXTERNAL) == IDS  # confirmed by the master, announced as shared
    # B never computed these tokens: the shared store has them
    m = b.match_prefix(TOKENS)
    assert m.best_len == 0
    assert b.prefetch(TOKENS, m)
    settle(b, eb)
    m = b.match_prefix(TOKENS)
    assert m.host_len == 16
    pages, last = b.init_load_back(m)
    settle(b, eb)
    assert b.is_loaded(last)
    for page, d in zip(pages, chain_digests(TOKENS, P)):
        assert page_matches(b.device, page, d)  # A's bytes, on B's device
    assert stored(sb, Medium.CPU_PINNED) == IDS and stored(sb, Medium.EXTERNAL) == IDS
    assert a.audit() == [] and b.audit() == []


def test_the_index_credits_the_shared_tier_to_every_worker_of_the_model(mooncake_master, workers) -> None:
    # the storage thread audits on its own every 300 ms (slower than the 100 ms lease a check takes)
    wa = Settled(mc(mooncake_master, audit_interval_s=0.3), idle_evict_poll_s=0.05)
    workers.append(wa)
    a, ea, sa = full_cache(wa)
    compute_and_insert(a, TOKENS + [7] * 8)
    settle(a, ea)
    a.evict(16)  # A keeps host copies only: its own rows say host, the pool says shared
    a.step(0.1)
    ix = KVIndex()
    ix.ensure_model("m", P)
    for wid in ("idle-1", "idle-2"):
        ix.register_worker("m", wid, 0)
    ix.apply("m", "a", 0, KVEventBatch(0.0, sa.events()))
    by = {w.worker_id: w for w in ix.score("m", TOKENS).workers}
    for wid in ("idle-1", "idle-2"):  # nothing local, the whole prefix skippable from the store
        assert by[wid].cached_blocks == 4 and by[wid].tiers["shared"] == 4 and by[wid].device_blocks == 0
    assert by["a"].tiers["host"] == 4
    # the store loses a page behind A's back: A's audit says so, and the index follows
    node = a.match_prefix(TOKENS).host_node
    gone = a._l3_keys(node)[-1]
    drop_behind_back(mooncake_master, [gone])
    n = len(sa.events())
    # the storage thread audits on its own (every 300 ms here): the cache learns it on a step
    wait_until(lambda: (a.step(0.2), removed(sa, Medium.EXTERNAL))[1], timeout=10.0)
    assert wa.backend.audit_losses == 1  # the node holding the page is un-claimed, whole
    ix.apply("m", "a", 0, KVEventBatch(0.1, sa.events()[n:]))
    idle = {w.worker_id: w for w in ix.score("m", TOKENS).workers}["idle-1"]
    assert idle.cached_blocks < 4  # no promise of the dropped page (nor of what hangs from it)
    for node in a.tree.nodes():  # every claim left is held by the store
        if node.stored:
            assert all(wa.backend.exists(a._l3_keys(node)))


@pytest.mark.parametrize("family,suffix", [("mamba", "mamba"), ("dsa", "dsa")])
def test_hybrid_node_round_trips_per_pool_and_part_of_a_node_is_absent(
        mooncake_master, workers, family: str, suffix: str) -> None:
    sizes = FamilySizes(page_size=P, device_pages=32, host_pages=64, mamba_states=8, host_mamba_states=16)
    tokens = list(range(100, 132))  # 8 pages

    def hybrid(w):
        sink = ListSink()
        eng = ManualTransferEngine()
        cache = build_family_cache(family, sizes, transfer=eng, storage=w, recorder=EventRecorder(sink),
                                   component_events=True, prefetch_threshold_tokens=P)
        return cache, eng, sink

    wa = worker(workers, mooncake_master)
    a, ea, sa = hybrid(wa)
    m = a.match_prefix(tokens)
    pages = a.alloc_device(8)
    comp = {}
    for c in a.components:
        comp[c.name] = a.alloc_component(c.name, 8) if c.per_page else {8: a.alloc_component(c.name, 1)[0]}
        for t in c.device.tensors:  # recognisable component state
            t.normal_()
    for x in a.extras:
        x.device.normal_()
    a.device.buffer.normal_()
    a.insert(tokens, m.device_pages + pages, component_pages=comp)
    settle(a, ea)
    node = a.match_prefix(tokens).host_node
    digests = a.tree.digest_list(node)
    be = wa.backend
    # one key per page per pool: the KV and the pool's own suffix
    assert all(be.exists([page_key(d) for d in digests]))
    held = be.exists([page_key(d, suffix) for d in digests])
    assert held == [True] * 8 if family == "dsa" else held[-1]  # a Mamba state at the node's end
    want_kv = [bytes(a.host.page_view(p)) for p in node.host_value]
    model = HybridModel(P)
    model.apply("a", sa.events())

    # worker B loads the node back, every pool
    wb = worker(workers, mooncake_master)
    b, eb, sb = hybrid(wb)
    assert b.prefetch(tokens, now=0.0)
    settle(b, eb)
    mb = b.match_prefix(tokens)
    assert mb.host_len == 32
    assert [bytes(b.host.page_view(p)) for p in mb.host_node.host_value] == want_kv
    model.apply("b", sb.events())
    assert model.usable("b", tokens)[1] == 8  # usable with its component state: the pools came whole
    # a node partly in the store is absent: drop one page's pool key, a third worker finds 0 pages
    drop_behind_back(mooncake_master, [page_key(digests[0], suffix) if family == "dsa" else page_key(digests[0])])
    wc = worker(workers, mooncake_master)
    c, ec, sc = hybrid(wc)
    assert c.prefetch(tokens, now=0.0)
    settle(c, ec)
    assert c.match_prefix(tokens).host_len == 0 and stored(sc, Medium.CPU_PINNED) == []
    assert c.host.allocator.used == 0  # the reserved host pages went back
    assert a.audit() == [] and b.audit() == [] and c.audit() == []


def test_host_memory_is_checked_before_a_load_back(mooncake_master, workers) -> None:
    wa, wb = worker(workers, mooncake_master), worker(workers, mooncake_master)
    a, ea, _ = full_cache(wa)
    compute_and_insert(a, TOKENS)
    settle(a, ea)
    b, eb, sb = full_cache(wb)
    held = b.host.alloc(16)  # B's host pool is full of pages it cannot evict
    assert not b.prefetch(TOKENS, now=0.0)
    assert b.stats["prefetch_no_host_memory"] == 1 and wb.inflight == 0  # nothing asked of the store
    b.host.free(held)
    assert b.prefetch(TOKENS, now=0.0)


def test_master_killed_mid_backup_worker_keeps_serving_and_claims_nothing(mooncake_master, workers) -> None:
    w = worker(workers, mooncake_master)
    cache, engine, sink = full_cache(w)
    compute_and_insert(cache, TOKENS)
    settle(cache, engine)
    assert stored(sink, Medium.EXTERNAL) == IDS
    second = [50] * 8
    compute_and_insert(cache, second)
    engine.complete()
    mooncake_master.kill()  # dies as the next backup is issued
    settle(cache, engine, 0.1)
    second_ids = page_ids(second, P)
    assert stored(sink, Medium.CPU_PINNED)[-2:] == second_ids
    assert not set(second_ids) & set(stored(sink, Medium.EXTERNAL))  # no claim of bytes the store lacks
    assert cache.stats.get("backup_failed_nodes", 0) >= 1
    cache.evict(16)
    cache.step(0.2)
    m = cache.match_prefix(second)
    assert m.host_len == 8  # served from its own host tier, intact
    for page, d in zip(m.host_node.host_value, cache.tree.digest_list(m.host_node)):
        assert page_matches(cache.host, page, d)
    assert m.host_node.host_ref == 0
    used = cache.host.allocator.used
    assert cache.prefetch([9] * 16, now=0.3)  # a shared store's contents are unknown: it is asked
    settle(cache, engine, 0.4)
    assert cache.match_prefix([9] * 16).host_len == 0 and cache.host.allocator.used == used  # pages back
    assert cache.audit() == []


def test_after_a_pressure_run_the_shared_tier_in_the_index_equals_the_store(tmp_path_factory) -> None:
    """The master evicts on its own (a 16 MiB pool, 32 MiB written) and tells nobody: the claims
    run ahead of the store until the audit has visited every claimed key; then the index's shared
    rows are exactly the nodes the store holds whole."""
    from support.mooncake import start_mooncake_master

    master = start_mooncake_master(tmp_path_factory.mktemp("mc"), "--default_kv_lease_ttl=50",
                                   "--eviction_high_watermark_ratio=0.7", "--eviction_ratio=0.3")
    be = mc(master, global_segment_size=16 << 20, audit_batch=128, audit_interval_s=1e-6)
    w = Settled(be, idle_evict_poll_s=None)
    sink = ListSink()
    eng = ManualTransferEngine()
    cache = build_cache(page_size=P, device_pages=128, host_pages=128, page_shape=(2, 8, 128), transfer=eng,
                        storage=w, recorder=EventRecorder(sink), prefetch_threshold_tokens=P)
    try:
        def lacking() -> int:
            return sum(1 for n in cache.tree.nodes() if n.stored and not all(be.exists(cache._l3_keys(n))))

        for c in range(16):  # 16 x 64 pages of 32 KiB
            compute_and_insert(cache, [c * 10_000 + i for i in range(64 * P)])
            settle(cache, eng)
            cache.evict(10 ** 9)
            cache.evict_host(10 ** 9)  # the L3 copies are all that is left: the store is the truth
            cache.step(0.0)
        if lacking() == 0 and be.audit_losses == 0:
            # The master's eviction runs on its own schedule (a full pool refuses puts until it has run,
            # and every lookup leases what it finds): where it has not dropped a claimed page yet, drop
            # some the way it does, behind the worker's back, so the audit has losses to find either way.
            stored = [n for n in cache.tree.nodes() if n.stored]
            drop_behind_back(master, [k for n in stored[: len(stored) // 2] for k in cache._l3_keys(n)])
        assert lacking() > 0 or be.audit_losses > 0  # claims ran ahead of the store
        claimed = len(be._ledger)
        drains = 0
        while lacking() and drains < 64:
            w.submit_exists([], None)  # an op: the storage thread drains and audits after it
            cache.step(0.0)
            drains += 1
        assert lacking() == 0 and be.audit_losses > 0
        # bounded: two passes of 128 keys a drain (removals shift the round-robin cursor)
        assert drains <= 2 * -(-claimed // 128) + 1
        ix = KVIndex()
        ix.ensure_model("m", P)
        ix.register_worker("m", "idle", 0)
        ix.apply("m", "a", 0, KVEventBatch(0.0, sink.events()))
        held = {n for n in cache.tree.nodes() if n.stored}
        assert held
        for c in range(16):  # the index promises a chunk's prefix exactly as far as the store holds it
            tokens = [c * 10_000 + i for i in range(64 * P)]
            idle = {x.worker_id: x for x in ix.score("m", tokens).workers}["idle"]
            m = cache.match_prefix(tokens)
            assert idle.tiers["shared"] * P == idle.cached_blocks * P == m.storage_len
    finally:
        w.close()
        be.close()
        master.stop()
