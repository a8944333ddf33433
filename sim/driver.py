"""A small driver that runs a synthetic request stream through a `TieredCache`, the way an engine
would: match → load-back → (prefetch at arrival) → allocate → "compute" → insert → step.

"Compute" writes a content-derived byte pattern into each new device page, so any page can later be
checked against the tokens it claims to hold (tests), or is skipped entirely (benchmarks).
Used by the tests, the demo and `bench/bench_producer.py`.
"""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import msgspec
import torch

from producer.allocator import PoolExhausted
from producer.events import EventRecorder
from producer.cache import CacheConfig, TieredCache
from producer.page_hash import chain_digests
from producer.pools import KVPool, make_device_pool, make_host_pool
from sim.hybrid import insert_request


class StreamSpec(msgspec.Struct, frozen=True, kw_only=True):
    requests: int = 200
    prefixes: int = 8            # distinct shared prefixes (system prompts, documents)
    prefix_tokens: int = 256
    suffix_tokens: int = 64
    vocab: int = 32000
    skew: float = 1.2            # Zipf-like popularity of the prefixes
    seed: int = 0


def synthetic_stream(spec: StreamSpec) -> Iterator[list[int]]:
    """Requests sharing popular prefixes (cut at random points) plus a unique suffix."""
    rng = random.Random(spec.seed)
    prefixes = [[rng.randrange(spec.vocab) for _ in range(spec.prefix_tokens)] for _ in range(spec.prefixes)]
    weights = [1.0 / (i + 1) ** spec.skew for i in range(spec.prefixes)]
    for _ in range(spec.requests):
        base = rng.choices(prefixes, weights)[0]
        cut = rng.randint(len(base) // 2, len(base)) if base else 0
        suffix = [rng.randrange(spec.vocab) for _ in range(rng.randint(1, max(1, spec.suffix_tokens)))]
        yield base[:cut] + suffix


# -- content-derived page bytes -----------------------------------------------------------------

def page_pattern(digest: bytes, nbytes: int) -> torch.Tensor:
    """The bytes a page of this content holds in the synthetic model (the digest, repeated)."""
    reps = -(-nbytes // len(digest))
    return torch.frombuffer(bytearray((digest * reps)[:nbytes]), dtype=torch.uint8)


def _page_view(pool: KVPool, page: int) -> torch.Tensor:
    return pool.buffer[page].reshape(-1).view(torch.uint8)


def write_pattern(pool: KVPool, page: int, digest: bytes) -> None:
    _page_view(pool, page).copy_(page_pattern(digest, pool.page_bytes))


def page_matches(pool: KVPool, page: int, digest: bytes) -> bool:
    return bool(torch.equal(_page_view(pool, page).cpu(), page_pattern(digest, pool.page_bytes)))


def compute_and_insert(cache: TieredCache, tokens: Sequence[int]) -> Any:
    """What a prefill does to the cache: the pages the device lacks allocated, written with each
    page's content pattern, and the whole prompt inserted. Returns `insert`'s answer."""
    m = cache.match_prefix(tokens)
    n = len(tokens) // cache.page_size
    new = cache.alloc_device(n - len(m.device_pages))
    for page, d in zip(new, chain_digests(tokens, cache.page_size)[len(m.device_pages):]):
        write_pattern(cache.device, page, d)
    return cache.insert(tokens, m.device_pages + new)


# -- building a cache ---------------------------------------------------------------------------

def build_cache(*, page_size: int, device_pages: int, host_pages: int = 0,
                page_shape: Sequence[int] = (2, 8), dtype: torch.dtype = torch.float32,
                transfer: Any = None, storage: Any = None, recorder: EventRecorder | None = None,
                host_reserve_bytes: int = 0, **config: Any) -> TieredCache:
    """Pools + controller with small defaults (tests, demo, bench). `transfer` is an engine or
    a kind for `make_transfer_engine`; `storage` a `StorageWorker` or None."""
    shape = (page_size, *page_shape)
    dev = make_device_pool(device_pages, page_size, shape, dtype)
    host = None
    if host_pages:
        host = make_host_pool(host_pages, page_size, shape, dtype, reserve_bytes=host_reserve_bytes)
        if transfer is None or isinstance(transfer, str):
            from producer.transfer import make_transfer_engine
            transfer = make_transfer_engine(transfer or "auto")
    return TieredCache(CacheConfig(page_size=page_size, **config), dev, host, transfer, storage, recorder)


# -- the driver ---------------------------------------------------------------------------------

class DriverStats(msgspec.Struct, kw_only=True):
    served: int = 0
    skipped: int = 0           # no device memory even after eviction and pumping acks
    no_component_memory: int = 0  # hybrid: KV inserted without its Mamba state / window (no slots left)
    tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    prefetches: int = 0


class Driver:
    """Serves requests FIFO with a small arrival queue: a request's L3 prefetch is issued when it
    arrives and it is served `lookahead` arrivals later, as a scheduler's waiting queue would."""

    __slots__ = ("cache", "fill", "pump", "lookahead", "max_retries", "chunk_pages", "stats", "_queue")

    def __init__(self, cache: TieredCache, *, fill: bool = True, lookahead: int = 2,
                 pump: Callable[[], None] | None = None, max_retries: int = 3, chunk_pages: int = 8) -> None:
        self.cache = cache
        self.chunk_pages = chunk_pages  # hybrid caches: a Mamba state at every chunk's end (sim.hybrid)
        self.fill = fill
        # makes outstanding copies land when memory is short (tests complete manual acks here)
        self.pump = pump if pump is not None else (lambda: cache.wait_transfers(5.0))
        self.lookahead = lookahead
        self.max_retries = max_retries
        self.stats = DriverStats()
        self._queue: deque[list[int]] = deque()

    def submit(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)
        cache = self.cache
        if cache.storage is not None:
            if cache.prefetch(tokens, cache.match_prefix(tokens)):
                self.stats.prefetches += 1
        self._queue.append(tokens)
        while len(self._queue) > self.lookahead:
            self.serve(self._queue.popleft())

    def drain(self) -> None:
        while self._queue:
            self.serve(self._queue.popleft())

    def run(self, stream: Iterable[Sequence[int]]) -> DriverStats:
        for tokens in stream:
            self.submit(tokens)
        self.drain()
        return self.stats

    def serve(self, tokens: Sequence[int]) -> bool:
        cache = self.cache
        p = cache.page_size
        npages = len(tokens) // p
        m = cache.match_prefix(tokens)
        pages, node = m.device_pages, m.device_node
        if m.host_len:
            pages, node = cache.init_load_back(m)
        self.stats.device_hit_tokens += m.device_len
        self.stats.host_hit_tokens += len(pages) * p - m.device_len
        cache.lock(node)  # type: ignore[arg-type]
        try:
            new = None
            for attempt in range(self.max_retries + 1):
                try:
                    new = cache.alloc_device(npages - len(pages))
                    break
                except PoolExhausted:
                    if attempt < self.max_retries:
                        if self.pump is not None:
                            self.pump()
                        cache.step()
            if new is None:
                self.stats.skipped += 1
                return False
            if self.fill and new:
                digests = cache.tree.chain(tokens[:npages * p], p)
                for page, d in zip(new, digests[len(pages):]):
                    write_pattern(cache.device, page, d)
            if not insert_request(cache, tokens, pages + new, len(pages), self.chunk_pages):
                self.stats.no_component_memory += 1
        finally:
            cache.unlock(node)  # type: ignore[arg-type]
        self.stats.served += 1
        self.stats.tokens += len(tokens)
        cache.step()
        return True
