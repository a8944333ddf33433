"""L3 integration of the tiered cache with the real storage worker and backends: file (local →
DISK) and a real redis-server started by the test (shared → EXTERNAL), including a Redis that dies
during backup and one that stalls past the prefetch deadline."""
from __future__ import annotations

import os
import signal

import pytest

from sim.driver import build_cache, compute_and_insert, page_matches, write_pattern
from producer.events import EventRecorder
from producer.page_hash import chain_digests, page_ids
from producer.sinks import ListSink
from producer.storage import FileStorageBackend, StorageWorker
from producer.transfer import ManualTransferEngine
from schemas.events import BlockRemoved, BlockStored
from schemas.media import Medium, parse_medium

P = 4
TOKENS = list(range(1, 17))  # 4 pages
IDS = page_ids(TOKENS, P)


def make(worker, device_pages=8, host_pages=8, **kw):
    sink = ListSink()
    engine = ManualTransferEngine()
    cache = build_cache(page_size=P, device_pages=device_pages, host_pages=host_pages, transfer=engine,
                        storage=worker, recorder=EventRecorder(sink), prefetch_threshold_tokens=P, **kw)
    return cache, engine, sink




def settle(cache, engine, worker, now):
    """Land every copy and storage op, then let the cache observe them."""
    for _ in range(4):  # a landed copy can start a backup, whose result needs another round
        engine.complete()
        cache.step(now)
        assert worker.wait_idle(10.0)
        cache.step(now)


def stored(sink, medium):
    return [h for e in sink.events() if isinstance(e, BlockStored) and parse_medium(e.medium) is medium
            for h in e.block_hashes]


def test_file_backend_backup_evict_prefetch_load_back(tmp_path) -> None:
    worker = StorageWorker(FileStorageBackend(tmp_path / "l3"))
    cache, engine, sink = make(worker)
    try:
        compute_and_insert(cache, TOKENS)
        engine.complete()
        cache.step(0.0)
        assert stored(sink, Medium.CPU_PINNED) == IDS and stored(sink, Medium.DISK) == []
        node = cache.match_prefix(TOKENS).device_node
        assert node.host_ref == 1  # the host copy stays protected until the backend confirms
        assert cache.evict_host(8) == 0
        assert worker.wait_idle(10.0)
        cache.step(0.1)
        assert stored(sink, Medium.DISK) == IDS  # local file store: DISK
        assert node.host_ref == 0
        # drop device and host copies: the node stays, L3-only
        cache.evict(8)
        assert cache.evict_host(8) == 4
        cache.step(0.2)
        m = cache.match_prefix(TOKENS)
        assert (m.device_len, m.host_len, m.storage_len) == (0, 0, 16)
        assert cache.resident_blocks() == {(i, Medium.DISK) for i in IDS}
        n_before = len(stored(sink, Medium.CPU_PINNED))
        assert cache.prefetch(TOKENS, m)
        assert not any(t is Medium.CPU_PINNED for _, t in cache.resident_blocks())  # not before it lands
        assert worker.wait_idle(10.0)
        cache.step(0.4)
        assert stored(sink, Medium.CPU_PINNED)[n_before:] == IDS  # on insertion into the host tier
        m = cache.match_prefix(TOKENS)
        assert m.host_len == 16
        pages, last = cache.init_load_back(m)
        engine.complete()
        cache.step(0.5)
        assert cache.is_loaded(last)
        for page, d in zip(pages, chain_digests(TOKENS, P)):
            assert page_matches(cache.device, page, d)  # bytes survived device→host→file→host→device
        assert cache.audit() == []
    finally:
        worker.close()


def test_file_backend_capacity_eviction_emits_removed(tmp_path) -> None:
    page_bytes = P * 2 * 8 * 4
    worker = StorageWorker(FileStorageBackend(tmp_path / "l3", capacity_bytes=4 * page_bytes))
    cache, engine, sink = make(worker, device_pages=16, host_pages=16)
    try:
        compute_and_insert(cache, TOKENS)
        settle(cache, engine, worker, 0.0)
        compute_and_insert(cache, [99] * 8)  # 2 more pages push the oldest L3 pages out
        settle(cache, engine, worker, 0.1)
        removed = [h for e in sink.events() if isinstance(e, BlockRemoved) and parse_medium(e.medium) is Medium.DISK
                   for h in e.block_hashes]
        assert removed and set(removed) <= set(IDS)
        disk = {i for i, m in cache.resident_blocks() if m is Medium.DISK}
        backend = worker.backend
        for node in cache.tree.nodes():  # every claimed L3 page is really in the store
            if node.stored:
                assert all(v is not None for v in backend.get(cache._l3_keys(node)))
        assert disk.isdisjoint(removed)
    finally:
        worker.close()


def test_shared_redis_backup_is_external_and_serves_another_worker(redis_server) -> None:
    from producer.storage import RedisStorageBackend

    wa = StorageWorker(RedisStorageBackend(redis_server.url, prefix="t:", shared=True))
    wb = StorageWorker(RedisStorageBackend(redis_server.url, prefix="t:", shared=True))
    a, ea, sa = make(wa)
    b, eb, sb = make(wb)
    try:
        compute_and_insert(a, TOKENS)
        settle(a, ea, wa, 0.0)
        assert stored(sa, Medium.EXTERNAL) == IDS
        # worker B never computed these tokens: it finds them in the shared store
        m = b.match_prefix(TOKENS)
        assert m.best_len == 0
        assert b.prefetch(TOKENS, m)
        settle(b, eb, wb, 0.0)
        m = b.match_prefix(TOKENS)
        assert m.host_len == 16
        for node in b.tree.nodes():
            for page, d in zip(node.host_value, b.tree.digest_list(node)):
                assert page_matches(b.host, page, d)
        assert stored(sb, Medium.CPU_PINNED) == IDS
    finally:
        wa.close()
        wb.close()


def test_killed_redis_loses_no_host_data_and_claims_nothing(redis_server) -> None:
    from producer.storage import RedisStorageBackend

    worker = StorageWorker(RedisStorageBackend(redis_server.url, prefix="k:", shared=True,
                                               socket_timeout=2.0, connect_timeout=0.5))
    cache, engine, sink = make(worker, device_pages=16, host_pages=16)
    try:
        compute_and_insert(cache, TOKENS)
        settle(cache, engine, worker, 0.0)
        assert stored(sink, Medium.EXTERNAL) == IDS
        second = [50] * 8
        compute_and_insert(cache, second)
        redis_server.stop()  # dies while the next backup is on its way
        settle(cache, engine, worker, 0.1)
        second_ids = page_ids(second, P)
        assert stored(sink, Medium.CPU_PINNED)[-2:] == second_ids
        assert not set(second_ids) & set(stored(sink, Medium.EXTERNAL))  # no false Stored(EXTERNAL)
        assert cache.stats.get("backup_failed_nodes", 0) >= 1
        cache.evict(16)  # the host copy is the only one left, and it is intact
        cache.step(0.2)
        m = cache.match_prefix(second)
        assert m.host_len == 8
        node = m.host_node
        for page, d in zip(node.host_value, cache.tree.digest_list(node)):
            assert page_matches(cache.host, page, d)
        assert node.host_ref == 0  # the failed backup released its host lock
        assert cache.audit() == []
    finally:
        worker.close()


def test_prefetch_past_its_deadline_is_abandoned(redis_server) -> None:
    from producer.storage import RedisStorageBackend

    worker = StorageWorker(RedisStorageBackend(redis_server.url, prefix="p:", shared=True, socket_timeout=5.0))
    writer_worker = StorageWorker(RedisStorageBackend(redis_server.url, prefix="p:", shared=True))
    w, we, _ = make(writer_worker)
    cache, engine, sink = make(worker, prefetch_timeout_base_s=0.5, prefetch_timeout_per_1k_tokens_s=1.0)
    try:
        compute_and_insert(w, TOKENS)
        settle(w, we, writer_worker, 0.0)
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # the store stalls
        try:
            assert cache.prefetch(TOKENS, now=10.0)
            assert cache.host.allocator.used == 4
            cache.step(10.4)
            assert cache.stats.get("prefetch_timeouts", 0) == 0
            cache.step(10.6)  # deadline = 10 + 0.5 + 1.0 * 16/1000
            assert cache.stats["prefetch_timeouts"] == 1
            # the read lands in its host pages directly: they stay held (not reusable) until it ends
            assert cache.host.allocator.used == 4 and cache.audit() == []
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert worker.wait_idle(10.0)
        cache.step(11.0)  # the late result is ignored, and its pages are free again
        assert cache.host.allocator.used == 0
        assert stored(sink, Medium.CPU_PINNED) == [] and cache.resident_blocks() == set()
        assert cache.audit() == []
    finally:
        worker.close()
        writer_worker.close()


def test_storage_needs_host_tier(tmp_path) -> None:
    worker = StorageWorker(FileStorageBackend(tmp_path))
    try:
        with pytest.raises(ValueError, match="needs a host tier"):
            build_cache(page_size=P, device_pages=4, storage=worker)
    finally:
        worker.close()
