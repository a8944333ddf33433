"""What a simulated hybrid worker keeps of a request's non-KV state when it inserts the request's
pages (docs/hybrid.md, "Hybrid workers"). One home for the rule, used by the engine and the driver.

- Mamba: a state at the end of every prefill chunk (`chunk_pages` pages, counted from where the
  computation started) and at the prompt's last full page: vLLM's prefix caching keeps the state
  at each scheduled chunk's end, so a later prompt may resume only from one of those.
- Sliding window: the window's pages at the prompt's end only; the pages that slid out of the
  window while prefill ran are freed, as vLLM's sliding-window manager does.
- Full attention and DSA (its extra pool rides on the KV pages): the KV alone.

The usable-prefix rule itself is the cache's (`TieredCache.match_prefix` of a hybrid cache): what
the worker serves from cache is what that match says is usable, never the full-attention run.
"""
from __future__ import annotations

from collections.abc import Sequence

from producer.allocator import PoolExhausted
from producer.cache import TieredCache
from producer.components.swa import SlidingWindowComponent


def mamba_ends(start: int, npages: int, chunk_pages: int) -> list[int]:
    """Page counts at whose end a Mamba state is kept: every chunk end after `start` (the pages
    already cached) and the prompt's last full page. Empty when nothing was computed."""
    if chunk_pages <= 0:
        raise ValueError("chunk_pages must be positive")
    if npages <= start:
        return []
    return [*range(start + chunk_pages, npages, chunk_pages), npages]


def insert_request(cache: TieredCache, tokens: Sequence[int], pages: Sequence[int], cached_pages: int,
                   chunk_pages: int) -> bool:
    """Insert a served request's full pages (`pages[i]` holds page i; the first `cached_pages` came
    from the cache) with its components' slots per the family's rule. Returns False when a
    component's memory ran out: the KV is inserted alone then (a prefix it cannot resume from)."""
    p = cache.page_size
    npages = len(tokens) // p
    comps = cache.components
    if not comps or npages == 0:
        cache.insert(tokens, pages)
        return True
    given: dict[str, object] = {}
    split_at = 0
    try:
        for c in comps:
            if isinstance(c, SlidingWindowComponent):
                need = min(npages, c.need)
                split_at = npages - need
                given[c.name] = [None] * split_at + cache.alloc_component(c.name, need)
            elif not c.per_page:
                ends = mamba_ends(cached_pages, npages, chunk_pages)
                given[c.name] = dict(zip(ends, cache.alloc_component(c.name, len(ends)))) if ends else {}
    except PoolExhausted:
        for c in comps:  # give back what was taken before the shortage
            g = given.get(c.name)
            slots = [s for s in (g.values() if isinstance(g, dict) else g or []) if s is not None]
            if slots:
                c.device.free(slots)
        cache.insert(tokens, pages)
        return False
    if split_at:
        # The window's first page must start a node (the cache attaches per-page state to whole
        # nodes): insert the part before it first, then the whole prompt on the pages the tree kept
        # for that part (it freed ours where it already held the KV).
        head = tokens[:split_at * p]
        cache.insert(head, pages[:split_at])
        path, _ = cache.tree.insert_path(cache.tree.page_key(head), cache.tick)
        pages = [pg for node, _ in path for pg in node.value or ()] + list(pages[split_at:])
    cache.insert(tokens, pages, component_pages=given)
    return True
