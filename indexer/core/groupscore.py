"""Scoring the workers with groups (hybrid layouts, indexer/core/groups.py): usable prefixes.

For a depth L, every full-attention group of the worker's layout (its main tree included) must hold
blocks [0, L), every sliding-window group (window W tokens) the last cdiv(W - 1, block_size) blocks
before L, every Mamba group a state at block L - 1; L = 0 is always usable. `device_blocks` asks the
GPU alone, `cached_blocks` allows any tier (the shared pool included) per block; `kv_blocks` is the
worker's main tree's (its primary full-attention group's) match over any tier, whatever the usable
prefix and the other groups are: what an index counting KV alone would say. Each block of the usable
prefix is split to the most expensive of the cheapest tiers of the groups that need it there.

Consecutive blocks whose full-attention residencies are equal form one run, so the full-attention
prefix and split cost one step per run and worker (like indexer/core/scoring.py). A window of a
sliding-window group is judged by its distinct residency values (few: blocks are held in runs).
Workers whose layouts share groups share the lookups: each group's values are read once per score.
"""
from __future__ import annotations

from itertools import groupby
from typing import TYPE_CHECKING, Any

from indexer.core.groups import FULL, MAMBA
from indexer.core.types import TierWeights, WorkerScore

if TYPE_CHECKING:
    from indexer.core.state import ModelState, WorkerState

ABSENT = 4  # a block's tier code when the group does not hold it (0..3: gpu, host, disk, shared)


def _code(r: int, sh: int, pool_bits: int) -> int:
    """The cheapest tier (0 gpu .. 3 shared pool) holding a block for the worker at shift `sh`."""
    own = (r >> sh) & 7
    if own:
        return 0 if own & 1 else 1 if own & 2 else 2
    return 3 if r & pool_bits else ABSENT


def _usable(top: int, parts: list[tuple[int, int | None, list[int]]], sh: int, pool_bits: int, limit: int) -> int:
    """Largest L <= top (the full-attention prefix) at which every sliding-window / Mamba group
    validates an end with tiers <= limit (0: the GPU alone; 3: any tier). L = 0 always.

    L only goes down, so each group judges each block at most once per value: a sliding-window group
    keeps the lowest block `good[k]` of the run it verified below the current L (a window is judged
    by its distinct residency values; L drops to its lowest failing block, which rules out every end
    up to span blocks above it), a Mamba group scans down to its next state. Tier look-ups:
    O(blocks x groups) per worker whatever the residency pattern (a hostile layout cannot make a
    score quadratic in them)."""
    good: list[int] = [top] * len(parts)  # per SWA group: blocks [good[k], L) are known to qualify
    L = top
    moved = True
    while moved and L > 0:
        moved = False
        for k, (kind, span, vals) in enumerate(parts):
            if kind == MAMBA:
                j = L - 1
                while j >= 0 and _code(vals[j], sh, pool_bits) > limit:
                    j -= 1
                if j + 1 < L:
                    L = j + 1
                    moved = True
                    if not L:
                        return 0
                continue
            lo = 0 if span is None else max(0, L - span)
            hi = min(good[k], L)
            if hi <= lo:
                good[k] = hi
                continue
            seg = vals[lo:hi]  # judged by its distinct values (few: blocks are held in runs)
            bad = {x for x in set(seg) if _code(x, sh, pool_bits) > limit}
            if not bad:
                good[k] = lo
                continue
            j = lo
            while seg[j - lo] not in bad:
                j += 1
            # the lowest failing block j: no end in (j, j + span] can use it (L among them), and
            # [lo, j) qualifies for the ends below
            L = j
            good[k] = lo
            moved = True
            if not L:
                return 0
    return L


def score_groups(m: ModelState, keys: list[int], weights: TierWeights, slots: list[WorkerState]) -> list[WorkerScore]:
    """The rows of `slots` (workers with a hybrid layout), unranked (module docstring)."""
    main = []
    for r in map(m.nodes.get, keys):  # no worker holds KV past the first absent block
        if r is None:
            break
        main.append(r)
    n = len(main)
    values: dict[int, list[int]] = {}  # id(group) -> its residency per query block, read once

    def vals(g: Any) -> list[int]:
        v = values.get(id(g))
        if v is None:
            v = values[id(g)] = [x or 0 for x in map(g.nodes.get, keys[:n])]
        return v

    main_runs = [(v, len(list(grp))) for v, grp in groupby(main)]
    shapes: dict[tuple[int, ...], tuple[list, list]] = {}  # layout -> (full-attention runs, other parts)
    pool_bits = m.slot_mask << 3
    wt = weights.as_tuple()
    bs = m.block_size
    out = []
    for w in slots:
        groups = w.layout.groups.values()
        sig = tuple(sorted(id(g) for g in groups))
        shape = shapes.get(sig)
        if shape is None:
            fulls = [main] + [vals(g) for g in groups if g.kind == FULL]
            runs = [(vt, len(list(grp))) for vt, grp in groupby(zip(*fulls))]
            parts = [(g.kind, g.span, vals(g)) for g in groups if g.kind != FULL]
            shape = shapes[sig] = (runs, parts)
        runs, parts = shape
        sh = w.shift
        coded: list[tuple[int, int, int]] = []  # (start, length, tier of the full-attention groups)
        pos = 0
        dev_top = -1
        for vt, ln in runs:
            c = max(_code(v, sh, pool_bits) for v in vt)
            if c == ABSENT:
                break
            if c and dev_top < 0:
                dev_top = pos
            coded.append((pos, ln, c))
            pos += ln
        full = pos  # every full-attention group holds [0, full)
        dev = _usable(full if dev_top < 0 else dev_top, parts, sh, pool_bits, 0)
        cached = _usable(full, parts, sh, pool_bits, 3)
        kv = 0  # the main tree's own match, over any tier: what an index counting KV alone says
        for v, ln in main_runs:
            if _code(v, sh, pool_bits) == ABSENT:
                break
            kv += ln
        split = [0, 0, 0, 0]
        for start, ln, c in coded:
            if start >= cached:
                break
            split[c] += min(ln, cached - start)
        # A block a sliding-window / Mamba group needs at `cached` costs at least that group's tier.
        raised: dict[int, int] = {}
        for kind, span, gv in parts:
            lo = cached - 1 if kind == MAMBA else 0 if span is None else max(0, cached - span)
            if cached == 0 or lo >= cached:
                continue
            codes = {x: _code(x, sh, pool_bits) for x in set(gv[lo:cached])}
            if max(codes.values()) == 0:
                continue  # all on the GPU: costs nothing more than the KV
            for i in range(lo, cached):
                c = codes[gv[i]]
                if c > raised.get(i, 0):
                    raised[i] = c
        for i, c in raised.items():
            base = next(cc for start, ln, cc in coded if start <= i < start + ln)
            if c > base:
                split[base] -= 1
                split[c] += 1
        out.append(WorkerScore(
            w.worker_id, w.dp_rank, dev, cached, {"gpu": split[0], "host": split[1], "disk": split[2], "shared": split[3]},
            float(bs * (split[0] * wt[0] + split[1] * wt[1] + split[2] * wt[2] + split[3] * wt[3])), kv,
        ))
    return out
