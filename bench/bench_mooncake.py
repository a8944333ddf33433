"""Mooncake Store as the L3: backup and load-back GB/s through `TieredCache` (`--l3 mooncake`)
against `MooncakeDistributedStore`'s own batch put/get of the same host pages, same client, same
run — and how stale the shared tier gets under memory pressure.

    .venv/bin/python -m bench.bench_mooncake                  # 64 pages of 2 MiB, 15 rounds
    .venv/bin/python -m bench.bench_mooncake --pages 32 --rounds 3 --pressure-pages 2048

Throughput: each round backs up a fresh prefix of `--pages` pages through the cache (host → store:
`_backup_to_storage` → StorageWorker → `batch_put_from` on views of the host pages), then drops it
from the device and host tiers and loads it back (`prefetch` → `batch_get_into` the reserved host
pages). The peer writes / reads the very same host pages with `batch_put_from` / `batch_get_into`
on the backend's own client under other keys. Both sides alternate order per round; the median
GB/s and the ratio are printed. Wall time on a shared machine: read the ratios.

Staleness: a master whose pool is smaller than what the worker writes evicts on its own (it tells
nobody); the worker's audit finds the losses. Reported: claimed-but-gone pages right after the
writes, and the drains (audit rounds) until the index-visible claims equal the store's contents.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GLOG_minloglevel", "2")  # before the Mooncake client loads: its INFO lines are noise

import torch  # noqa: E402

from producer.events import EventRecorder  # noqa: E402
from producer.page_hash import chain_digests  # noqa: E402
from sim.driver import build_cache, page_matches, write_pattern  # noqa: E402
from producer.sinks import ListSink  # noqa: E402
from producer.storage import StorageWorker, make_storage_backend  # noqa: E402
from producer.storage.mooncake_master import start_mooncake_master  # noqa: E402
from producer.transfer import ManualTransferEngine  # noqa: E402
from schemas.events import BlockRemoved, BlockStored  # noqa: E402
from schemas.media import Medium, parse_medium  # noqa: E402

PAGE_TOKENS = 16
PAGE_SHAPE = (32, 2, 8, 128)  # per token: 32 layers of K and V, 8 heads of 128 (Llama-3-8B): 128 KiB fp16
SMALL_SHAPE = (2, 8, 128)  # the pressure run's pages: one layer, 64 KiB a page


PAGE_BYTES = PAGE_TOKENS * 32 * 2 * 8 * 128 * 2  # 2 MiB: one object a page, every layer (page_first)


def _addr(view: memoryview) -> int:
    import numpy as np
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def make_cache(worker: StorageWorker, pages: int, page_shape: tuple[int, ...] = PAGE_SHAPE):
    sink = ListSink()
    eng = ManualTransferEngine()
    cache = build_cache(page_size=PAGE_TOKENS, device_pages=pages, host_pages=pages, page_shape=page_shape,
                        dtype=torch.float16, transfer=eng, storage=worker, recorder=EventRecorder(sink),
                        prefetch_threshold_tokens=PAGE_TOKENS, prefetch_timeout_base_s=600.0)
    return cache, eng, sink


def insert(cache, tokens: list[int]) -> None:
    n = len(tokens) // PAGE_TOKENS
    pages = cache.alloc_device(n)
    for page, d in zip(pages, chain_digests(tokens, PAGE_TOKENS)):
        write_pattern(cache.device, page, d)
    cache.insert(tokens, pages)


def cache_round(cache, eng, worker: StorageWorker, tokens: list[int]) -> tuple[float, float]:
    """(backup seconds, load-back seconds) of one prefix through the cache."""
    insert(cache, tokens)
    eng.complete()  # device → host lands; the step below issues the backup
    t0 = time.perf_counter()
    cache.step(0.0)
    assert worker.wait_idle(600.0)
    cache.step(0.0)
    t_backup = time.perf_counter() - t0
    m = cache.match_prefix(tokens)
    assert m.host_node is not None and m.host_node.stored, "backup not confirmed"
    cache.evict(10 ** 9)
    cache.evict_host(10 ** 9)
    cache.step(0.0)
    m = cache.match_prefix(tokens)
    assert m.host_len == 0 and m.storage_len == len(tokens)
    t0 = time.perf_counter()
    assert cache.prefetch(tokens, m, now=0.0)
    assert worker.wait_idle(600.0)
    cache.step(0.0)
    t_load = time.perf_counter() - t0
    m = cache.match_prefix(tokens)
    assert m.host_len == len(tokens), f"loaded back {m.host_len} of {len(tokens)} tokens"
    node = m.host_node
    for page, d in zip(node.host_value, cache.tree.digest_list(node)):  # bytes survived the trip
        assert page_matches(cache.host, page, d)
    cache.evict_host(10 ** 9)
    cache.step(0.0)
    # free the round's objects (both sides do): every round writes into warm pool memory, not
    # into pages the kernel faults in for the first time
    backend = worker.backend
    keys = backend._ledger.keys()
    backend._store.batch_remove([backend._k(k) for k in keys], True)
    for k in keys:
        backend._ledger.remove(k)
    return t_backup, t_load


def raw_round(store, cache, pages: list[int], tag: str) -> tuple[float, float]:
    """The same host pages through the client's own zero-copy batch calls, in the state the cache's
    backup finds them: just written by a device-to-host copy (untimed on both sides)."""
    host = cache.host
    host.buffer[pages] = cache.device.buffer[list(range(len(pages)))]  # the copy the engine makes
    views = [host.page_view(p) for p in pages]
    keys = [f"raw:{tag}:{i}" for i in range(len(pages))]
    ptrs = [_addr(v) for v in views]
    sizes = [v.nbytes for v in views]
    t0 = time.perf_counter()
    codes = store.batch_put_from(keys, ptrs, sizes)
    t_put = time.perf_counter() - t0
    assert all(c == 0 for c in codes), f"raw put failed: {set(codes)}"
    t0 = time.perf_counter()
    got = store.batch_get_into(keys, ptrs, sizes)
    t_get = time.perf_counter() - t0
    assert got == sizes, f"raw get failed: {sorted(set(got))}"
    store.batch_remove(keys, True)
    return t_put, t_get


def throughput(master, pages: int, rounds: int) -> dict[str, float]:
    page_bytes = PAGE_BYTES
    seg = max(256 << 20, 4 * pages * page_bytes)
    # the audit is measured apart (staleness below): here it would add its lookups to either side
    backend = make_storage_backend("mooncake", master.backend_config(global_segment_size=seg,
                                                                      local_buffer_size=64 << 20,
                                                                      audit_interval_s=3600.0))
    worker = StorageWorker(backend, max_inflight=1 << 20)
    cache, eng, _ = make_cache(worker, pages)
    try:
        cache_round(cache, eng, worker, [7] * (pages * PAGE_TOKENS))  # connect + warm up
        store = backend._store
        host_pages = cache.host.alloc(pages)
        # touch the whole pool once (fill, then free it): no side pays the kernel's first-touch
        # page faults for pool memory the allocator hands it
        views = [cache.host.page_view(p) for p in host_pages]
        fill: list[str] = []
        for i in range(seg // (pages * page_bytes)):
            keys = [f"fill:{i}:{j}" for j in range(pages)]
            if any(store.batch_put_from(keys, [_addr(v) for v in views], [v.nbytes for v in views])):
                break
            fill += keys
        store.batch_remove(fill, True)
        raw_round(store, cache, host_pages, "warm")
        cb, cl, rp, rg = [], [], [], []
        for r in range(rounds):
            tokens = [r + 1000 * (i + 1) for i in range(pages * PAGE_TOKENS)]
            order = [0, 1] if r % 2 == 0 else [1, 0]
            for side in order:
                if side == 0:
                    cache.host.free(host_pages)
                    b, lb = cache_round(cache, eng, worker, tokens)
                    host_pages = cache.host.alloc(pages)
                    cb.append(b)
                    cl.append(lb)
                else:
                    p, g = raw_round(store, cache, host_pages, str(r))
                    rp.append(p)
                    rg.append(g)
        gb = pages * page_bytes / 1e9
        out = {}
        for stat, f in (("median", statistics.median), ("best", min)):
            out.update({f"{stat}_cache_backup": gb / f(cb), f"{stat}_cache_load": gb / f(cl),
                        f"{stat}_raw_put": gb / f(rp), f"{stat}_raw_get": gb / f(rg)})
        # each round's two sides ran back to back: the median of the per-round ratios cancels the
        # load other processes put on the machine from one round to the next
        out["paired_backup"] = statistics.median(r / c for r, c in zip(rp, cb))
        out["paired_load"] = statistics.median(r / c for r, c in zip(rg, cl))
        return out
    finally:
        worker.close()
        backend.close()


def staleness(log_dir: Path, pages: int) -> dict[str, int]:
    """A pool of 64 MiB, a worker writing `pages` pages of 64 KiB (more than fit): the master
    evicts on its own and tells nobody; the worker's audit (`audit_batch` keys a drain) finds it."""
    master = start_mooncake_master(log_dir, "--default_kv_lease_ttl=50", "--eviction_high_watermark_ratio=0.8",
                                   "--eviction_ratio=0.2")
    audit_batch = 512
    backend = make_storage_backend("mooncake", master.backend_config(global_segment_size=64 << 20,
                                                                      audit_batch=audit_batch, audit_interval_s=1e-6))
    worker = StorageWorker(backend, max_inflight=1 << 20, idle_evict_poll_s=None)
    chunk = 128
    cache, eng, sink = make_cache(worker, chunk * 2, SMALL_SHAPE)

    def claimed() -> set[int]:
        s: set[int] = set()
        for e in sink.events():
            if isinstance(e, BlockStored) and parse_medium(e.medium) is Medium.EXTERNAL:
                s.update(e.block_hashes)
            elif isinstance(e, BlockRemoved) and parse_medium(e.medium) is Medium.EXTERNAL:
                s.difference_update(e.block_hashes)
        return s

    def lacking() -> int:
        """Claimed nodes (index-visible) the store no longer holds whole."""
        return sum(1 for n in cache.tree.nodes() if n.stored and not all(backend.exists(cache._l3_keys(n))))

    try:
        for c in range(pages // chunk):
            insert(cache, [c * 100_000 + i for i in range(chunk * PAGE_TOKENS)])
            eng.complete()
            cache.step(0.0)  # backups issued
            assert worker.wait_idle(600.0)
            cache.step(0.0)  # confirmed: Stored(EXTERNAL)
            cache.evict(10 ** 9)
            cache.evict_host(10 ** 9)  # only the L3 copies remain: the store's contents are the truth
            cache.step(0.0)
        before = claimed()
        stale_nodes = lacking()
        keys_claimed = len(backend._ledger)
        audited0 = backend.audited_keys
        drains = 0
        while lacking() and drains < 10_000:
            backend._next_audit = 0.0
            worker.submit_exists([], None)  # an op: the storage thread drains (and audits) after it
            assert worker.wait_idle(60.0)
            cache.step(0.0)
            drains += 1
        after = claimed()
        return {"written_pages": pages // chunk * chunk, "claimed_before": len(before), "claimed_after": len(after),
                "stale_nodes_before": stale_nodes, "drains": drains, "keys_claimed": keys_claimed,
                "audited_keys": backend.audited_keys - audited0, "lacking_after": lacking(),
                "audit_losses": backend.audit_losses}
    finally:
        worker.close()
        backend.close()
        master.stop()


def main() -> None:
    torch.set_num_threads(1)  # a shared 2-core machine: no intra-op thread pool fighting the others
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--pressure-pages", type=int, default=4096)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-mooncake-") as tmp:
        master = start_mooncake_master(Path(tmp), "--default_kv_lease_ttl=1000")
        try:
            t = throughput(master, args.pages, args.rounds)
        finally:
            master.stop()
        mb = args.pages * PAGE_BYTES / (1 << 20)
        print(f"pages {args.pages} x 2 MiB ({mb:.0f} MiB a round), {args.rounds} rounds, GB/s (wall time, shared machine):")
        for stat in ("median", "best"):
            g = {k[len(stat) + 1:]: v for k, v in t.items() if k.startswith(stat)}
            print(f"  {stat:6} backup    TieredCache {g['cache_backup']:7.2f}   batch_put_from {g['raw_put']:7.2f}   "
                  f"ratio {g['cache_backup'] / g['raw_put']:.2f}x")
            print(f"  {stat:6} load-back TieredCache {g['cache_load']:7.2f}   batch_get_into {g['raw_get']:7.2f}   "
                  f"ratio {g['cache_load'] / g['raw_get']:.2f}x")
        print(f"  median of per-round ratios: backup {t['paired_backup']:.2f}x   load-back {t['paired_load']:.2f}x")
        if args.pressure_pages:
            s = staleness(Path(tmp), args.pressure_pages)
            print(f"pressure: {s['written_pages']} pages of 64 KiB into a 64 MiB pool (the master evicts on its own)")
            stale = s['claimed_before'] - s['claimed_after']
            print(f"  right after the writes: {s['claimed_before']} blocks claimed EXTERNAL, {stale} of them "
                  f"({100 * stale / max(1, s['claimed_before']):.0f}%, in {s['stale_nodes_before']} nodes) no longer "
                  f"held whole by the store (the master evicted them and told nobody)")
            print(f"  the audit withdrew them in {s['drains']} drains of 512 keys ({s['audited_keys']} keys checked "
                  f"of {s['keys_claimed']} claimed, {s['audit_losses']} found gone); claimed nodes the store lacks "
                  f"after: {s['lacking_after']}")


if __name__ == "__main__":
    main()
