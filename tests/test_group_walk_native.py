"""The C usable-prefix search (`hybrid_rows`, indexer/_native/groups_walk.c) against a brute force of
the rule in docs/hybrid.md on random residency: holes, host / disk / shared-pool tiers, runs of equal
values, windows narrower and wider than the query, no window, sparse Mamba states, several groups of
a kind, worker-sharded tables and queries crossing the search's aligned reads. The brute force judges
every end L from the top down, every block of it, with none of the search's shortcuts (runs, reads,
a window judged from its bottom up, known-good ranges)."""
from __future__ import annotations

import random

import pytest

from indexer.core import native as native_core

N = native_core.select(True)
ABSENT = 4
POOL = 0x8888888888888888_8888888888888888_8888888888888888


def _code(v: int | None, sh: int, pool: bool) -> int:
    own = (v >> sh) & 7 if v is not None else 0
    if own:
        return 0 if own & 1 else 1 if own & 2 else 2
    return 3 if pool else ABSENT


def _brute(n: int, tabs: list, layout: tuple, slot: int, nm: int) -> tuple:
    """(dev, cached, kv, gpu, host, disk, shared) of the worker at `slot`: tabs[0] the main tree,
    tabs[1 + g] group g as (kind, span, [per block: per shard value or None])."""
    t, sh = slot % nm, 4 * (slot // nm)

    def code(tab: list, i: int) -> int:
        vals = tab[i]
        return _code(vals[t], sh, any(v is not None and v & POOL for v in vals))

    fulls = [tabs[0][2]] + [tabs[1 + g][2] for g in layout if tabs[1 + g][0] == 0]
    parts = [tabs[1 + g] for g in layout if tabs[1 + g][0] != 0]
    ftier = []
    for i in range(n):
        c = max(code(f, i) for f in fulls)
        if c == ABSENT:
            break
        ftier.append(c)
    full = len(ftier)
    kv = next((i for i in range(n) if code(tabs[0][2], i) == ABSENT), n)

    def need(kind: int, span: int, L: int) -> range:
        if kind == 2:
            return range(L - 1, L)
        return range(0 if span < 0 else max(0, L - span), L)

    def usable(top: int, limit: int) -> int:
        for L in range(top, 0, -1):
            if all(code(vals, i) <= limit for kind, span, vals in parts for i in need(kind, span, L)):
                return L
        return 0

    dev_top = next((i for i, c in enumerate(ftier) if c), full)
    dev, cached = usable(dev_top, 0), usable(full, 3)
    tier = ftier[:cached]
    for kind, span, vals in parts:
        if cached:
            for i in need(kind, span, cached):
                tier[i] = max(tier[i], code(vals, i))
    return (dev, cached, kv, *(tier.count(x) for x in range(4)))


def _value(rng: random.Random, slots: list[int], nm: int, t: int, dense: float) -> int | None:
    """A block's value in shard t: each of that shard's workers holds it with probability `dense`,
    on a random tier (sometimes the shared pool alone)."""
    v = 0
    for s in slots:
        if s % nm == t and rng.random() < dense:
            v |= rng.choice((1, 1, 1, 2, 4, 3, 8, 9)) << (4 * (s // nm))
    return v if v or rng.random() < 0.1 else None  # a key held with no worker's bit: still a node


def _case(seed: int) -> None:
    rng = random.Random(seed)
    nm = rng.choice((1, 1, 2, 3))
    nw = rng.randint(1, 20)
    slots = rng.sample(range(nw * nm + 8), nw)
    n = rng.choice((1, 3, 15, 16, 17, 31, 33, 64, 70, 129))
    keys = rng.sample(range(1, 1 << 62), n)
    ng = rng.randint(1, 5)
    spans = (-1, 1, 2, 3, 5, 17, 32, 33, 200)

    def column(dense: float, mamba: bool) -> list:
        """Per block, per shard: runs of one residency (as one request's blocks), holes between."""
        out, cur = [], None
        for i in range(n):
            if cur is None or rng.random() < 0.2:
                d = dense if not mamba or rng.random() < 0.3 else 0.0
                cur = [_value(rng, slots, nm, t, d) for t in range(nm)]
            out.append(list(cur))
        return out

    main = column(0.8, False)
    cut = rng.randint(0, n)  # no shard holds the main tree past here: the walk's end
    for i in range(cut, n):
        main[i] = [None] * nm
    tabs = [(0, -1, main)]
    for _ in range(ng):
        kind = rng.choice((0, 1, 1, 2, 2))
        tabs.append((kind, rng.choice(spans) if kind == 1 else -1, column(rng.choice((0.3, 0.7, 0.95)), kind == 2)))
    maps = []
    for kind, span, vals in tabs:
        shards = [N.U64Map() for _ in range(nm)]
        for i, k in enumerate(keys):
            for t in range(nm):
                if vals[i][t] is not None:
                    shards[t][k] = vals[i][t]
        maps.append(shards[0] if nm == 1 else tuple(m if len(m) else {} for m in shards))
    groups = [(kind, span, maps[1 + g]) for g, (kind, span, _) in enumerate(tabs[1:])]
    layouts = [tuple(rng.sample(range(ng), rng.randint(0, ng))) for _ in slots]
    got = N.hybrid_rows(maps[0], keys, None, 0, 16, groups, layouts, slots)
    assert got is not None
    assert got[0] == n
    # the walk stops at the first block no shard of the main tree holds
    walked = next((i for i in range(n) if all(v is None for v in main[i])), n)
    want = [_brute(walked, tabs, lay, s, nm) for lay, s in zip(layouts, slots)]
    assert got[1] == want, (seed, nm, n, [(k, s) for k, s, _ in tabs], layouts, slots)


@pytest.mark.parametrize("seed", range(400))
def test_hybrid_rows_equal_the_brute_force_rule(seed: int) -> None:
    _case(seed)


def test_a_window_gone_below_the_top_is_judged_from_its_bottom() -> None:
    """A long chain whose window group holds only its last span + 8 blocks (a request's out-of-window
    removes) and Mamba states every 8 blocks: the last state's end is usable, every end below the
    kept window is not, whatever the query's length."""
    n, span = 300, 40
    keys = list(range(1, n + 1))
    main, win, mam = N.U64Map(), N.U64Map(), N.U64Map()
    for k in keys:
        main[k] = 0b1
    for k in keys[-span - 8:]:
        win[k] = 0b1
    for i, k in enumerate(keys):
        if (i + 1) % 8 == 0:
            mam[k] = 0b1
    groups = [(1, span, win), (2, -1, mam)]
    assert N.hybrid_rows(main, keys, None, 0, 16, groups, [(0, 1)], [0])[1] == [(n - 4, n - 4, n, n - 4, 0, 0, 0)]
    for q in (n - 41, 200, 64, 33, 1):
        assert N.hybrid_rows(main, keys[:q], None, 0, 16, groups, [(0, 1)], [0])[1] == [(0, 0, q, 0, 0, 0, 0)]


@pytest.mark.parametrize("seed", range(200))
def test_pure_usable_search_equals_the_brute_force_rule(seed: int) -> None:
    """The pure core's search (`groupscore._usable`, the C search's twin: a window judged from its
    bottom up, L dropping to its lowest failing block) against every end judged in full."""
    from indexer.core.groupscore import _usable

    rng = random.Random(seed)
    n = rng.randint(0, 90)
    sh = 4 * rng.randint(0, 3)
    parts = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice((1, 2))
        vals, cur = [], 0
        for _ in range(n):
            if rng.random() < 0.25:
                cur = rng.choice((0, 0, 1, 2, 4, 8)) << sh if rng.random() < 0.8 else rng.choice((0, 8)) << (sh ^ 4)
            vals.append(cur)
        parts.append((kind, rng.choice((None, 1, 2, 5, 17, 40)) if kind == 1 else None, vals))
    pool_bits = 0x8888
    for limit in (0, 1, 3):
        top = rng.randint(0, n)
        want = next((L for L in range(top, 0, -1) if all(
            _code(vals[i] or None, sh, bool(vals[i] & pool_bits)) <= limit
            for kind, span, vals in parts
            for i in (range(L - 1, L) if kind == 2 else range(0 if span is None else max(0, L - span), L)))), 0)
        assert _usable(top, parts, sh, pool_bits, limit) == want
