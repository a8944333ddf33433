"""What a simulated hybrid worker keeps of a request's non-KV state when it inserts the request's
pages (docs/hybrid.md, "Hybrid workers"). One home for the rule, used by the engine and the driver.

- Mamba: a state at the end of every prefill chunk (`chunk_pages` pages, counted from where the
  computation started) and at the prompt's last full page (SGLang's MambaRadixCache inserts one at
  each chunk and at the request's end; vLLM's "align" mode keeps the chunk-end states), plus one at
  the branching point: where the request's full-attention match ran past its last usable state
  (SGLang's `mamba_branching_seqlen`).
- Sliding window: the window KV of every page of the prefill chunks completed before the last one
  (SGLang's SWARadixCache owns them from the chunk's insert on), of the window at the prompt's end
  and of the window at the branching point (`swa_branching_seqlen`); the last chunk's other pages
  that slid out of the window are freed by the request.
- Full attention and DSA (its extra pool rides on the KV pages): the KV alone.

Component state lives in its own bounded pools (the cache's `SlotPool`s) with its own LRU: taking a
slot tombstones the least recently used state while its KV stays, which is when a full-attention
match overstates what the worker can resume from.

The usable-prefix rule itself is the cache's (`TieredCache.match_prefix` of a hybrid cache): what
the worker serves from cache is what that match says is usable, never the full-attention run.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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


def swa_pages(start: int, npages: int, chunk_pages: int, need: int, branch: int = 0) -> list[int]:
    """Pages whose sliding-window KV a request leaves in the cache (SGLang's SWARadixCache): every
    page of the prefill chunks it completed before its last one (inserted chunk by chunk, so the
    tree owns them), the window's pages at the prompt's end and, at a branching point `branch` (the
    end of a full-attention run it matched past its usable prefix: SGLang's swa_branching_seqlen),
    the window's pages there; the last chunk's other pages that slid out of the window are freed by
    the request itself. Pages before `start` came from the cache."""
    if npages <= start:
        return []
    ends = mamba_ends(start, npages, chunk_pages)
    last_start = ends[-2] if len(ends) > 1 else start
    keep = {*range(start, last_start), *range(max(0, npages - need), npages)}
    if start < branch < npages:
        keep.update(range(max(start, branch - need), branch))
    return sorted(keep)


def insert_request(cache: TieredCache, tokens: Sequence[int], pages: Sequence[int], cached_pages: int,
                   chunk_pages: int, branch_pages: int = 0) -> bool:
    """Insert a served request's full pages (`pages[i]` holds page i; the first `cached_pages` came
    from the cache) with its components' slots per the family's rule. `branch_pages`: the end of the
    full-attention run the request matched past its usable prefix (SGLang's branching point: the
    engine keeps a Mamba state / the window there too, so the next request sharing that run resumes
    from it).
    Returns False when a component's memory ran out: the KV is inserted alone then."""
    p = cache.page_size
    npages = len(tokens) // p
    comps = cache.components
    if not comps or npages == 0:
        cache.insert(tokens, pages)
        return True
    given: dict[str, Any] = {}
    cuts: set[int] = set()
    try:
        for c in comps:
            if isinstance(c, SlidingWindowComponent):
                keep = swa_pages(cached_pages, npages, chunk_pages, c.need, branch_pages)
                slots = iter(cache.alloc_component(c.name, len(keep)))
                kept = set(keep)
                given[c.name] = [next(slots) if i in kept else None for i in range(npages)]
                # per-page state attaches to whole nodes: a node must start and end where a kept run does
                cuts.update(i for i in range(1, npages) if (i in kept) != (i - 1 in kept))
            elif not c.per_page:
                ends = mamba_ends(cached_pages, npages, chunk_pages)
                if cached_pages < branch_pages < npages and branch_pages not in ends:
                    ends = sorted([*ends, branch_pages])
                given[c.name] = dict(zip(ends, cache.alloc_component(c.name, len(ends)))) if ends else {}
    except PoolExhausted:
        for c in comps:  # give back what was taken before the shortage
            g = given.get(c.name)
            slots_ = [s for s in (g.values() if isinstance(g, dict) else g or []) if s is not None]
            if slots_:
                c.device.free(slots_)
        cache.insert(tokens, pages)
        return False
    if cuts:
        # Insert the prefix up to each cut first (the nodes then end there), then the whole prompt on
        # the pages the tree kept (it freed ours where it already held the KV).
        pages = list(pages)
        for cut in sorted(cuts):
            head = tokens[:cut * p]
            cache.insert(head, pages[:cut])
            path, _ = cache.tree.insert_path(cache.tree.page_key(head), cache.tick)
            pages = [pg for node, _ in path for pg in node.value or ()] + pages[cut:]
    cache.insert(tokens, pages, component_pages=given)
    return True
