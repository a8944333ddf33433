"""Random hybrid producer histories shared by the producer-side and the index-side property tests
(tests/test_hybrid_property.py, tests/test_hybrid_index_property.py): one small cache per family
(page size 2, every tier, manual copy acks, an in-memory L3) and the operations a history is made of."""
from __future__ import annotations

import random
from typing import Any

from hypothesis import strategies as st

from producer.components.families import FamilySizes, build_family_cache
from producer.events import EventRecorder
from producer.sinks import ListSink
from producer.storage import MemoryStorageBackend, StorageWorker
from producer.transfer import ManualTransferEngine

P = 2  # page size


class Settled(StorageWorker):
    """L3 writes and evictions settle before they are read, so each step is deterministic."""

    def drain_evicted(self):  # noqa: ANN201
        assert self.wait_idle(5.0)
        return super().drain_evicted()

    def poll(self):  # noqa: ANN201
        assert self.wait_idle(5.0)
        return super().poll()


def ops(max_size: int) -> Any:
    """(kind, a, b) steps: requests, copy acks, evictions per tier and component, prefetches."""
    kinds = ["req"] * 4 + ["ack"] * 4 + ["evict"] * 2 + ["tomb"] * 2 + ["evict_host", "tomb_host", "prefetch", "step"]
    return st.lists(st.tuples(st.sampled_from(kinds), st.integers(0, 5), st.integers(1, 8)),
                    min_size=10, max_size=max_size)


class History:
    """One family's cache with its copy engine, L3 worker and event sink, driven step by step."""

    def __init__(self, family: str, opt_in: bool, seed: int) -> None:
        self.rng = random.Random(seed)
        self.bases = [[self.rng.randrange(50) for _ in range(16)] for _ in range(3)]
        self.sink = ListSink()
        self.eng = ManualTransferEngine()
        self.storage = Settled(MemoryStorageBackend(capacity_bytes=P * 2 * 8 * 4 * 40))
        sizes = FamilySizes(page_size=P, device_pages=16, host_pages=24, mamba_states=4, host_mamba_states=6,
                            window=3, swa_device_pages=12, swa_host_pages=16)
        self.cache = build_family_cache(family, sizes, transfer=self.eng, storage=self.storage,
                                        recorder=EventRecorder(self.sink), component_events=opt_in,
                                        prefetch_threshold_tokens=P)
        self.now = 0.0
        self.seen = 0

    def tokens(self, a: int, b: int) -> list[int]:
        return self.bases[a % 3][:2 * P + (b * P) // 2] + ([a] * P if a > 2 else [])

    def request(self, tokens: list[int]) -> None:
        """Match, load back, allocate KV and component slots, insert (skipped when memory is exhausted)."""
        cache = self.cache
        m = cache.match_prefix(tokens)
        pages, node = cache.init_load_back(m) if m.host_len else (m.device_pages, m.device_node)
        cache.lock(node)
        try:
            n = len(tokens) // P
            try:
                new = cache.alloc_device(n - len(pages))
                comp: dict = {}
                for c in cache.components:
                    if c.per_page:
                        comp[c.name] = [None] * len(pages) + cache.alloc_component(c.name, n - len(pages))
                    else:
                        comp[c.name] = {k: cache.alloc_component(c.name, 1)[0] for k in sorted({max(1, n // 2), n})}
            except Exception:  # noqa: BLE001 - memory exhausted: the request is skipped
                return
            cache.insert(tokens, pages + new, component_pages=comp)
        finally:
            cache.unlock(node)

    def step(self, kind: str, a: int, b: int) -> tuple[list[int], list[Any]]:
        """Run one operation and a scheduler step; returns the step's tokens and the new events."""
        cache, tokens = self.cache, self.tokens(a, b)
        if kind == "req":
            self.request(tokens)
        elif kind == "ack":
            ids = self.eng.pending_ids()
            self.rng.shuffle(ids)
            self.eng.complete(ids[:b])
        elif kind == "evict":
            cache.evict(b)
        elif kind == "evict_host":
            cache.evict_host(b)
        elif kind == "tomb" and cache.components:
            cache.evict_component(cache.components[0].name, b)
        elif kind == "tomb_host" and cache.components:
            cache.evict_component(cache.components[0].name, b, tier="host")
        elif kind == "prefetch":
            cache.prefetch(tokens, now=self.now)
        self.now += 0.1
        cache.step(self.now)
        ev = self.sink.events()
        new, self.seen = ev[self.seen:], len(ev)
        return tokens, list(new)

    def usable(self, tokens: list[int]) -> tuple[int, int]:
        """The producer's own usable (device, best) pages for `tokens`."""
        cache = self.cache
        path, _ = cache.tree.match(cache.tree.page_key(tokens), cache.tick, cache._usable)
        dev, _host, best, _ = cache.usable_pages(path)
        return dev, best

    def close(self) -> None:
        self.storage.close()
