"""Unit tests of the producer core: page hashes, pools, radix tree, recorder, sinks, the tiered
controller's emission table (with a manual transfer engine, so acks happen exactly when we say)."""
from __future__ import annotations

import pytest
import torch

from producer.allocator import PageAllocator, PoolExhausted
from sim.driver import Driver, StreamSpec, build_cache, compute_and_insert, page_matches, synthetic_stream, write_pattern
from producer.events import CANONICAL_MEDIA, EventRecorder
from producer.page_hash import chain_digests, page_ids
from producer.pools import make_host_pool
from producer.radix_tree import RadixTree
from producer.sinks import EventLogSink, ListSink, TeeSink, ZmqSink
from producer.transfer import ManualTransferEngine
from schemas.codec import decode_batch
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from schemas.media import Medium, parse_medium

TOKENS_1_12 = list(range(1, 13))
SGLANG_IDS_1_12_P4 = [-3488128144981237669, 5674439469042975057, -1307369107475853156]


# -- page hashes -------------------------------------------------------------------------------

def test_sglang_page_hash_vector() -> None:
    assert page_ids(TOKENS_1_12, 4) == SGLANG_IDS_1_12_P4


def test_page_hash_ignores_partial_trailing_page_and_chains() -> None:
    assert page_ids(TOKENS_1_12 + [13, 14], 4) == SGLANG_IDS_1_12_P4
    # chaining: the second page's id depends on the first page
    assert page_ids([9, 9, 9, 9] + TOKENS_1_12[4:8], 4)[1] != SGLANG_IDS_1_12_P4[1]
    tail = chain_digests(TOKENS_1_12[4:], 4, prior=chain_digests(TOKENS_1_12[:4], 4)[0])
    assert tail == chain_digests(TOKENS_1_12, 4)[1:]


# -- pools ---------------------------------------------------------------------------------------

def test_allocator_exhaustion_and_double_free_are_clear_errors() -> None:
    a = PageAllocator(4, "device pool")
    pages = a.alloc(3)
    with pytest.raises(PoolExhausted, match=r"asked for 2 pages but only 1 of 4 are free"):
        a.alloc(2)
    a.free(pages[:1])
    with pytest.raises(ValueError, match="double free"):
        a.free(pages[:1])
    assert a.available == 2 and a.used == 2


def test_host_pool_refuses_naming_the_numbers() -> None:
    with pytest.raises(MemoryError, match=r"needs 4096 bytes \(16 pages x 256 bytes\).*only 1000 bytes"):
        make_host_pool(16, 4, (4, 2, 8), torch.float32, reserve_bytes=0, available_bytes=1000)
    pool = make_host_pool(16, 4, (4, 2, 8), torch.float32, reserve_bytes=0, available_bytes=10_000)
    assert pool.buffer.shape == (16, 4, 2, 8) and pool.page_bytes == 256


def test_page_bytes_round_trip_and_size_check() -> None:
    pool = make_host_pool(2, 1, (1, 4), torch.float16, reserve_bytes=0)
    pool.buffer[0] = torch.arange(4, dtype=torch.float16)
    pool.page_from_bytes(1, pool.page_to_bytes(0))
    assert torch.equal(pool.buffer[1], pool.buffer[0])
    with pytest.raises(ValueError, match="expected 8"):
        pool.page_from_bytes(1, b"\0" * 7)


# -- radix tree ----------------------------------------------------------------------------------

def test_tree_page_alignment_split_and_hash_lists() -> None:
    t = RadixTree(4)
    key = t.page_key(TOKENS_1_12 + [13, 14])
    assert len(key) == 12  # partial trailing page never cached
    path, new = t.insert_path(key, 1)
    assert new is path[-1][0] and len(path) == 1
    assert t.ensure_hashes(new) == SGLANG_IDS_1_12_P4
    # a query diverging inside the second page splits at the page boundary before it
    matched, n = t.match(t.page_key([1, 2, 3, 4, 5, 6, 99, 8]), 2)
    assert n == 4 and [len(x.key) for x in matched] == [4]
    parent = matched[0]
    assert t.ensure_hashes(parent) == SGLANG_IDS_1_12_P4[:1] and t.ensure_hashes(new) == SGLANG_IDS_1_12_P4[1:]
    assert len(parent.digests) == 32 and len(new.digests) == 64  # one blob per node, split at the page
    assert new.parent is parent and t.parent_id(new) == SGLANG_IDS_1_12_P4[0]


def test_tree_lru_eviction_respects_locks() -> None:
    t = RadixTree(1)
    a = t.insert_path((1, 2), 1)[1]
    b = t.insert_path((3, 4), 2)[1]
    for n in (a, b):
        n.value = [0, 0]
    t.inc_lock(a)
    evicted = []

    def ev(n):
        evicted.append(n)
        n.value = None
        return 2

    freed = t.evict_lru(10, lambda n: n.value is not None and n.lock_ref == 0, ev)
    assert freed == 2 and evicted == [b]
    t.dec_lock(a)
    with pytest.raises(RuntimeError, match="underflow"):
        t.dec_lock(a)


# -- recorder and sinks -------------------------------------------------------------------------

def test_recorder_coalesces_chains_and_heartbeats_when_idle() -> None:
    sink = ListSink()
    rec = EventRecorder(sink, media_names=CANONICAL_MEDIA, heartbeat_interval_s=1.0)
    rec.stored([1, 2], None, [0] * 8, 4, Medium.GPU)
    rec.stored([3], 2, [0] * 4, 4, Medium.GPU)        # continues the chain -> same event
    rec.stored([4], 2, [0] * 4, 4, Medium.GPU)        # sibling -> new event
    rec.stored([5], 4, [0] * 4, 4, Medium.CPU_PINNED)  # other tier -> new event
    rec.removed([1], Medium.GPU)
    rec.removed([2], Medium.GPU)
    assert rec.flush(10.0) == 4
    evs = sink.events()
    assert [type(e).__name__ for e in evs] == ["BlockStored", "BlockStored", "BlockStored", "BlockRemoved"]
    assert evs[0].block_hashes == [1, 2, 3] and len(evs[0].token_ids) == 12
    assert evs[3].block_hashes == [1, 2]
    assert rec.flush(10.5) == 0 and sink.heartbeats == 0  # idle, but not for long enough
    rec.flush(11.0)
    assert sink.heartbeats == 1 and sink.batches[-1].events == []


def test_event_log_sink_and_tee_share_payload_and_seq(tmp_path) -> None:
    from indexer.eventlog import EventLogWriter, read_event_log

    class Capture(EventLogSink):
        __slots__ = ("payloads",)

    w1 = EventLogWriter(tmp_path / "a.kvlog")
    w2 = EventLogWriter(tmp_path / "b.kvlog")
    tee = TeeSink(EventLogSink(w1, "w0"), EventLogSink(w2, "w0"))
    rec = EventRecorder(tee, heartbeat_interval_s=0.0)
    rec.stored(SGLANG_IDS_1_12_P4, None, TOKENS_1_12, 4, Medium.GPU)
    rec.flush(1.0)
    rec.flush(2.0)  # heartbeat
    rec.close(3.0)
    a = list(read_event_log(tmp_path / "a.kvlog"))
    b = list(read_event_log(tmp_path / "b.kvlog"))
    assert [f.seq for f in a] == [0, 1, 2] and [f.payload for f in a] == [f.payload for f in b]
    batch = decode_batch(a[0].payload, normalize=False)
    assert batch.events[0].block_hashes == SGLANG_IDS_1_12_P4 and batch.events[0].medium == "GPU"
    assert decode_batch(a[1].payload).events == []


def test_zmq_sink_publishes_over_a_real_socket(zmq_ctx, free_port, wait_until) -> None:
    import zmq

    from producer.publisher import ZmqEventPublisher

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = ZmqEventPublisher(endpoint)
    sub = zmq_ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    rec = EventRecorder(ZmqSink(pub), heartbeat_interval_s=0.0)
    try:
        got = []

        def received():  # PUB/SUB slow joiner: heartbeat until the subscriber is connected
            rec.flush(0.0)
            while sub.poll(10):
                got.append(sub.recv_multipart())
            return got

        wait_until(received, timeout=10.0)
        rec.stored(SGLANG_IDS_1_12_P4, None, TOKENS_1_12, 4, Medium.GPU)
        rec.flush(1.0)

        def stored_seen():
            while sub.poll(10):
                got.append(sub.recv_multipart())
            return any(decode_batch(m[2]).events for m in got)

        wait_until(stored_seen, timeout=10.0)
        seqs = [int.from_bytes(m[1], "big") for m in got]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        ev = next(e for m in got for e in decode_batch(m[2]).events)
        assert ev.block_hashes == [h & (2**64 - 1) for h in SGLANG_IDS_1_12_P4]
    finally:
        sub.close(0)
        rec.close(2.0)


# -- the tiered controller: emission table -----------------------------------------------------

def make(policy="write_through", device_pages=16, host_pages=16, page_size=4, **kw):
    sink = ListSink()
    engine = ManualTransferEngine()
    cache = build_cache(page_size=page_size, device_pages=device_pages, host_pages=host_pages,
                        transfer=engine, recorder=EventRecorder(sink), write_policy=policy, **kw)
    return cache, engine, sink




def tiers(events):
    return [(type(e).__name__, parse_medium(e.medium).name if not isinstance(e, AllBlocksCleared) else None)
            for e in events]


def test_insert_emits_gpu_store_and_host_store_only_after_ack() -> None:
    cache, engine, sink = make()
    compute_and_insert(cache, TOKENS_1_12 + [13])
    cache.step(0.0)
    assert tiers(sink.events()) == [("BlockStored", "GPU")]
    assert sink.events()[0].block_hashes == SGLANG_IDS_1_12_P4
    assert engine.inflight == 1
    cache.step(0.1)  # copy issued but not landed: nothing new
    assert tiers(sink.events()) == [("BlockStored", "GPU")]
    assert (SGLANG_IDS_1_12_P4[0], Medium.CPU_PINNED) not in cache.resident_blocks()
    engine.complete()
    cache.step(0.2)
    assert tiers(sink.events())[-1] == ("BlockStored", "CPU_PINNED")
    assert {(i, Medium.CPU_PINNED) for i in SGLANG_IDS_1_12_P4} <= cache.resident_blocks()


def test_split_emits_nothing_and_second_request_shares_prefix() -> None:
    cache, engine, sink = make(policy="write_through_selective")
    compute_and_insert(cache, TOKENS_1_12)
    cache.step(0.0)
    before = len(sink.events())
    assert compute_and_insert(cache, TOKENS_1_12[:8] + [50, 51, 52, 53]) == 8
    cache.step(0.1)
    new = sink.events()[before:]
    assert tiers(new) == [("BlockStored", "GPU")]
    assert new[0].parent_block_hash == SGLANG_IDS_1_12_P4[1] and len(new[0].block_hashes) == 1
    assert engine.inflight == 0  # selective: nothing is hot yet
    assert cache.audit() == []


def test_selective_write_through_copies_after_threshold_hits() -> None:
    cache, engine, sink = make(policy="write_through_selective", write_through_threshold=2)
    compute_and_insert(cache, TOKENS_1_12)
    compute_and_insert(cache, TOKENS_1_12)
    assert engine.inflight == 0
    compute_and_insert(cache, TOKENS_1_12)  # second hit
    assert engine.inflight == 1
    engine.complete()
    cache.step(0.0)
    assert ("BlockStored", "CPU_PINNED") in tiers(sink.events())


def test_device_eviction_keeps_host_copy_then_load_back_emits_on_ack() -> None:
    cache, engine, sink = make(device_pages=4)
    compute_and_insert(cache, TOKENS_1_12)
    engine.complete()
    cache.step(0.0)
    compute_and_insert(cache, [77] * 4)  # 4th page: fits
    cache.step(0.1)
    engine.complete()
    cache.step(0.2)
    n = len(sink.events())
    compute_and_insert(cache, [88] * 8)  # needs 2 pages: evicts the LRU leaves
    engine.complete()
    cache.step(0.3)
    evs = sink.events()[n:]
    assert ("BlockRemoved", "GPU") in tiers(evs)
    m = cache.match_prefix(TOKENS_1_12)
    assert m.device_len + m.host_len == 12 and m.host_len > 0
    pages, node = cache.init_load_back(m)
    cache.step(0.4)
    n = len(sink.events())
    assert not cache.is_loaded(node)
    assert tiers(sink.events()[n:]) == []  # SGLang would have emitted Stored(GPU) here
    engine.complete()
    cache.step(0.5)
    assert tiers(sink.events()[n:]) == [("BlockStored", "GPU")]
    assert cache.is_loaded(node)
    for page, d in zip(pages, chain_digests(TOKENS_1_12, 4)):
        assert page_matches(cache.device, page, d)  # the bytes read back are the bytes written


def test_device_eviction_without_host_copy_deletes_node() -> None:
    cache, _engine, sink = make(policy="write_through_selective", device_pages=3, host_pages=4)
    compute_and_insert(cache, TOKENS_1_12)
    compute_and_insert(cache, [5] * 4)
    cache.step(0.0)
    assert tiers(sink.events())[-2:] == [("BlockRemoved", "GPU"), ("BlockStored", "GPU")]
    assert sink.events()[-2].block_hashes == SGLANG_IDS_1_12_P4  # LRU leaf, no host copy: gone
    assert cache.match_prefix(TOKENS_1_12).best_len == 0
    assert cache.resident_blocks() == {(i, Medium.GPU) for i in page_ids([5] * 4, 4)}
    assert cache.audit() == []


def test_write_back_copies_before_evicting() -> None:
    cache, engine, sink = make(policy="write_back", device_pages=3, host_pages=8)
    compute_and_insert(cache, TOKENS_1_12)
    assert engine.inflight == 0
    with pytest.raises(PoolExhausted):
        compute_and_insert(cache, [5] * 4)  # eviction had to start a write-back first
    assert engine.inflight == 1
    engine.complete()
    cache.step(0.0)
    compute_and_insert(cache, [5] * 4)
    cache.step(0.1)
    t = tiers(sink.events())
    assert t.index(("BlockStored", "CPU_PINNED")) < t.index(("BlockRemoved", "GPU"))
    assert cache.match_prefix(TOKENS_1_12).host_len > 0


def test_host_eviction_and_reset() -> None:
    cache, engine, sink = make(device_pages=3, host_pages=3)
    compute_and_insert(cache, TOKENS_1_12)
    engine.complete()
    cache.step(0.0)
    cache.evict(3)
    assert cache.evict_host(1) == 3  # the only host-leaf holds all three pages
    cache.step(0.1)
    assert tiers(sink.events())[-1] == ("BlockRemoved", "CPU_PINNED")
    assert cache.resident_blocks() == set() and cache.audit() == []
    compute_and_insert(cache, TOKENS_1_12)  # a copy in flight during reset
    cache.reset()
    cache.step(0.2)
    assert isinstance(sink.events()[-1], AllBlocksCleared)
    engine.complete()  # the cancelled copy lands: its pages go back to the pool, no event
    cache.step(0.3)
    assert isinstance(sink.events()[-1], AllBlocksCleared)
    assert cache.device.allocator.used == 0 and cache.host.allocator.used == 0


def test_failed_copy_is_never_announced() -> None:
    cache, engine, sink = make()
    compute_and_insert(cache, TOKENS_1_12)
    engine.fail(engine.pending_ids())
    cache.step(0.0)
    assert ("BlockStored", "CPU_PINNED") not in tiers(sink.events())
    assert cache.host.allocator.used == 0 and cache.stats["copy_failed_d2h"] == 1


def test_insert_takes_ownership_and_frees_duplicates() -> None:
    cache, _engine, _sink = make(policy="write_through_selective")
    compute_and_insert(cache, TOKENS_1_12)
    dup = cache.alloc_device(3)  # an engine recomputed the same prefix
    assert cache.insert(TOKENS_1_12, dup) == 12
    assert cache.device.allocator.used == 3 and cache.audit() == []
    with pytest.raises(ValueError, match="got only 1 device pages"):
        cache.insert([1] * 8, [0])


def test_driver_runs_a_stream_with_thread_engine() -> None:
    sink = ListSink()
    cache = build_cache(page_size=16, device_pages=64, host_pages=128, transfer="thread",
                        recorder=EventRecorder(sink))
    try:
        stats = Driver(cache).run(
            synthetic_stream(StreamSpec(requests=60, prefixes=4, prefix_tokens=256, suffix_tokens=64)))
        cache.wait_transfers(5.0)
        cache.step()
        assert stats.served == 60 and stats.device_hit_tokens + stats.host_hit_tokens > 0
        kinds = set(tiers(sink.events()))
        assert {("BlockStored", "GPU"), ("BlockStored", "CPU_PINNED"), ("BlockRemoved", "GPU")} <= kinds
        assert cache.audit() == []
    finally:
        cache.transfer.close()
