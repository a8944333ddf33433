"""Scoring a query against one model namespace (design §5). Pure function over ModelState.

The walk looks up the query's chained keys in order. Consecutive blocks with the same residency
value are one run (typical: a shared prefix held by the same workers), so per-worker counting is
done once per run, not once per block; the walk stops at the first block no live worker can use.
Keys are looked up in growing chunks (`map(dict.get)` runs in C) so a short match does not pay
for the whole query and a long one pays little more than the dict lookups.
This is the reference; the C accelerator's `score_rows` does the same walk and ranking in one call
(`indexer.core.accel`, docs/index-core.md).
"""
from __future__ import annotations

from itertools import groupby

from indexer.core.groupscore import score_groups
from indexer.core.state import ModelState, WorkerState
from indexer.core.types import ScoreResult, TierWeights, WorkerScore

_FIRST_CHUNK = 16


def _bits(mask: int) -> list[int]:
    """Slot numbers whose GPU-position bit (4*slot) is set."""
    out = []
    while mask:
        low = mask & -mask
        out.append((low.bit_length() - 1) >> 2)
        mask ^= low
    return out


def walk(m: ModelState, keys: list[int], live: int) -> tuple[dict[int, int], dict[int, int], dict[int, list[int]]]:
    """Per slot: device_blocks, cached_blocks, per-tier split. `live` = GPU-position bits of slots to score."""
    nodes = m.nodes
    M = m.slot_mask & live
    pool_bits = m.slot_mask << 3  # any worker's EXTERNAL claim, scored or not, puts a block in the pool
    dev_alive = M
    cache_alive = M
    device: dict[int, int] = {}
    cached: dict[int, int] = {}
    split: dict[int, list[int]] = {}
    depth = 0
    pos = 0
    n = len(keys)
    chunk = _FIRST_CHUNK
    get = nodes.get
    while pos < n and cache_alive:
        vals = list(map(get, keys[pos : pos + chunk]))
        stop = False
        try:
            cut = vals.index(None)
            vals = vals[:cut]
            stop = True
        except ValueError:
            pass
        pos += chunk
        chunk *= 4
        for r, grp in groupby(vals):
            run = len(list(grp))
            g = r & M
            h = (r >> 1) & M
            d = (r >> 2) & M
            any_t = g | h | d
            avail = cache_alive if r & pool_bits else any_t & cache_alive
            gone = cache_alive & ~avail
            if gone:
                for s in _bits(gone):
                    cached[s] = depth
                cache_alive = avail
                if not cache_alive:
                    break
            dgone = dev_alive & ~g
            if dgone:
                for s in _bits(dgone):
                    device[s] = depth
                dev_alive &= g
            # Cheapest tier per worker for this run: gpu < host < disk < shared.
            on_g = g & cache_alive
            on_h = h & cache_alive & ~g
            on_d = d & cache_alive & ~(g | h)
            on_s = cache_alive & ~any_t
            for t, mask in ((0, on_g), (1, on_h), (2, on_d), (3, on_s)):
                for s in _bits(mask):
                    sp = split.get(s)
                    if sp is None:
                        sp = split[s] = [0, 0, 0, 0]
                    sp[t] += run
            depth += run
        if stop:
            break
    for s in _bits(cache_alive):
        cached[s] = depth
    for s in _bits(dev_alive):
        device[s] = depth
    return device, cached, split


def score_keys(
    m: ModelState, keys: list[int], weights: TierWeights, workers: list[tuple[str, int]] | None = None
) -> ScoreResult:
    """Per-worker prefix match of chained keys, weighted and ranked best first (the tie-break: more
    cached blocks, then (worker_id, dp_rank))."""
    if workers is None:
        slots = [w for w in m.workers if w is not None]
    else:
        slots = [w for w in (m.by_id.get((wid, int(r))) for wid, r in workers) if w is not None]
    hybrid: list[WorkerState] = []
    if m.groups is not None:  # workers with groups score usable prefixes (docs/hybrid.md), the others as before
        hybrid = [w for w in slots if w.layout is not None and w.layout.groups]
        if hybrid:
            slots = [w for w in slots if w.layout is None or not w.layout.groups]
    live = 0
    for w in slots:
        live |= 1 << w.shift
    device, cached, split = walk(m, keys, live) if keys and live else ({}, {}, {})
    rows = [(device.get(w.slot, 0), cached.get(w.slot, 0), *split.get(w.slot, (0, 0, 0, 0))) for w in slots]
    bs = m.block_size
    wg, wh, wd, ws = weights.as_tuple()
    out = []
    for w, (dev, cach, g, h, d, sh) in zip(slots, rows):
        out.append(WorkerScore(
            w.worker_id, w.dp_rank, dev, cach, {"gpu": g, "host": h, "disk": d, "shared": sh},
            float(bs * (g * wg + h * wh + d * wd + sh * ws)),
        ))
    if hybrid:
        out += score_groups(m, keys, weights, hybrid)
    out.sort(key=rank_key)
    return ScoreResult(query_blocks=len(keys), block_size=bs, workers=out)


def rank_key(s: WorkerScore) -> tuple:
    return (-s.score, -s.cached_blocks, s.worker_id, s.dp_rank)
