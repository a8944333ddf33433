"""Scoring a query against one model namespace (design §5). Pure function over ModelState.

The walk looks up the query's chained keys in order. Consecutive blocks with the same residency
value are one run (typical: a shared prefix held by the same workers), so per-worker counting is
done once per run, not once per block; the walk stops at the first block no live worker can use.
Keys are looked up in growing chunks (`map(dict.get)` runs in C) so a short match does not pay
for the whole query and a long one pays little more than the dict lookups.
"""
from __future__ import annotations

from itertools import groupby

from indexer.core.state import ModelState
from indexer.core.types import TIER_NAMES, ScoreResult, TierWeights, WorkerScore

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
    nat = m.nat if type(keys) is list else None
    while pos < n and cache_alive:
        if nat is not None:
            vals = nat.prefix_values(nodes, keys, pos, pos + chunk)  # stops at the first absent key
            stop = len(vals) < min(chunk, n - pos)
        else:
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


def score_native(
    m: ModelState, keys: list[int] | None, tokens: object, seed: int, weights: TierWeights,
    workers: list[tuple[str, int]] | None = None,
) -> ScoreResult | None:
    """The whole score in one accelerator call (keys hashed from `tokens` when `keys` is None): walk,
    weights, ranking and the result rows. None when it cannot judge the input (the Python path does)."""
    if workers is None:
        _, slots, wids, ranks = m.ranked()
    else:
        ws = sorted(
            (w for w in (m.by_id.get((wid, int(r))) for wid, r in workers) if w is not None),
            key=lambda w: (w.worker_id, w.dp_rank),
        )
        slots, wids, ranks = [w.slot for w in ws], [w.worker_id for w in ws], [w.dp_rank for w in ws]
    res = m.nat.score_rows(
        m.nodes, keys, tokens, seed, m.block_size, slots, wids, ranks, weights.as_tuple(), WorkerScore, TIER_NAMES,
    )
    if res is None:
        return None
    return ScoreResult(query_blocks=res[0], block_size=m.block_size, workers=res[1])


def score_keys(
    m: ModelState, keys: list[int], weights: TierWeights, workers: list[tuple[str, int]] | None = None
) -> ScoreResult:
    if m.nat is not None and type(keys) is list:
        res = score_native(m, keys, None, 0, weights, workers)
        if res is not None:
            return res
    if workers is None:
        slots = [w for w in m.workers if w is not None]
    else:
        slots = [w for w in (m.by_id.get((wid, int(r))) for wid, r in workers) if w is not None]
    rows = None
    if m.nat is not None and type(keys) is list and keys and slots:
        rows = m.nat.walk(m.nodes, keys, [w.slot for w in slots])  # None: odd key, Python walk below
    if rows is None:
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
    out.sort(key=_rank)
    return ScoreResult(query_blocks=len(keys), block_size=bs, workers=out)


def _rank(s: WorkerScore) -> tuple:
    return (-s.score, -s.cached_blocks, s.worker_id, s.dp_rank)
