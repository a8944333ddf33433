"""Per-group residency for hybrid models (vLLM's group shape; docs/hybrid.md, "The indexer").

A model whose stream carries groups (`BlockStored.group_idx` with a full-attention, sliding-window
or Mamba `kv_cache_spec_kind`) gets a `GroupTable` on its ModelState, created by the first such store.
- The *primary* group is the model's main tree (`ModelState.nodes`, the worker's `ext`): group 0 /
  no group_idx when the model already holds blocks, else the first full-attention group seen.
- Every other known group keeps its own residency map (content key -> 4 tier bits per slot, the
  same layout as the main tree) and per worker its own `engine hash -> key` map. A group's store
  resolves its blocks through its own map, then the worker's main map (the KV block with the same
  hash), then by hashing its tokens from a resolvable parent; anything else is counted and dropped.
- Removes apply to their own group only; a remove for a group never seen in a store is counted
  (`unknown_group`) and ignored.
- Scoring (`score_groups`): the usable prefix. For a depth L, every full-attention group must hold
  blocks [0, L), every sliding-window group (window W tokens) the last cdiv(W - 1, block_size) blocks
  before L, every Mamba group a state at block L - 1; L = 0 is always usable. `device_blocks` asks
  the GPU alone, `cached_blocks` allows any tier (the shared pool included) per block; `kv_blocks` is
  the full-attention-only match over any tier. Each block of the usable prefix is split to the most
  expensive of the cheapest tiers of the groups that need it there.
A model with no group but the primary is full-attention-only and never comes here.
"""
from __future__ import annotations

from collections.abc import Callable
from itertools import groupby
from typing import TYPE_CHECKING, Any

from indexer.core.state import clear_bits, move_bits, unset_tier
from indexer.core.types import (
    DROP_PLACEHOLDER, MEDIUM_NAMES, REMOVE_OUTCOMES, STORE_OUTCOMES,
    ApplyStats, ScoreResult, TierWeights, WorkerScore, full_block_hashes,
)
from indexer.hashing import CHAIN_P, MASK64, block_digest_py, extra_digest
from schemas.events import BlockRemoved, BlockStored, is_full_attention
from schemas.media import parse_medium
from schemas.rules import NIBBLE, slot_shift, window_blocks

if TYPE_CHECKING:
    from indexer.core.state import ModelState, WorkerState

FULL, SWA, MAMBA = 0, 1, 2
KIND_NAMES = ("full_attention", "sliding_window", "mamba")
ABSENT = 4  # a block's tier code when the group does not hold it (0..3: gpu, host, disk, shared)

DROP_UNKNOWN_GROUP = "unknown_group"
DROP_GROUP_KIND = "group_kind_conflict"
DROP_GROUP_ORPHAN = "group_orphan"
GROUP_STORED = "group_stored"
GROUP_REMOVED = "group_removed"


def classify(kind: str | None) -> int | None:
    """Group kind of a `kv_cache_spec_kind`: FULL, SWA, MAMBA, or None for kinds not modelled
    (chunked local, cross attention, encoder-only, the dump marker...): those stay skipped."""
    if is_full_attention(kind):
        return FULL
    k = (kind or "").lower()
    if k.startswith("kvatlas"):
        return None
    if "sliding" in k:
        return SWA
    if "mamba" in k:
        return MAMBA
    return None


def window_span(window: int | None, block_size: int) -> int | None:
    """Blocks a sliding-window group must hold before a match end: cdiv(W - 1, block_size)
    (vLLM's rule). None (no window announced): every block, like full attention."""
    if window is None:
        return None
    return window_blocks(window, block_size)


class Group:
    """One non-primary group of a model: residency per content key, and per worker slot its map."""

    __slots__ = ("idx", "kind", "window", "span", "nodes", "ext", "new_map")

    def __init__(self, idx: int, kind: int, window: int | None, block_size: int, new_map: Callable[[], Any]) -> None:
        self.idx = idx
        self.kind = kind
        self.window = window
        self.span = window_span(window, block_size) if kind == SWA else None
        self.new_map = new_map
        self.nodes: Any = new_map()
        self.ext: dict[int, Any] = {}  # slot -> (engine hash -> key)

    def slot_map(self, slot: int) -> Any:
        e = self.ext.get(slot)
        if e is None:
            e = self.ext[slot] = self.new_map()
        return e

    def clear_slot(self, slot: int) -> None:
        ext = self.ext.pop(slot, None)
        if not ext:
            return
        clear_bits(self.nodes, set(ext.values()), slot_shift(slot))

    def move_slot(self, old: int, new: int) -> None:
        """A worker moved from slot `old` to the free slot `new` (the model keeps slots dense)."""
        ext = self.ext.pop(old, None)
        if not ext:
            return
        self.ext[new] = ext
        move_bits(self.nodes, set(ext.values()), 4 * old, 4 * new)


class GroupTable:
    __slots__ = ("primary", "groups")

    def __init__(self, primary: int | None) -> None:
        self.primary = primary  # the main tree's group_idx (None until a full-attention group is seen)
        self.groups: dict[int, Group] = {}

    @property
    def hybrid(self) -> bool:
        return bool(self.groups)

    def clear_slot(self, slot: int) -> None:
        for g in self.groups.values():
            g.clear_slot(slot)

    def move_slot(self, old: int, new: int) -> None:
        for g in self.groups.values():
            g.move_slot(old, new)

    def kinds(self) -> dict[int, tuple[str, int | None]]:
        out: dict[int, tuple[str, int | None]] = {}
        if self.primary is not None:
            out[self.primary] = (KIND_NAMES[FULL], None)
        for i, g in self.groups.items():
            out[i] = (KIND_NAMES[g.kind], g.window)
        return out


# --- apply -------------------------------------------------------------------------------------

def route_store(m: ModelState, w: WorkerState, ev: BlockStored, stats: ApplyStats) -> bool:
    """Called for stores carrying a group_idx. True when handled here (a non-primary group's store or
    a counted drop); False: the main path applies (or skips) it as before."""
    gi = ev.group_idx
    kind = classify(ev.kv_cache_spec_kind)
    if kind is None or type(gi) is not int or gi < 0:
        return False  # not a modelled group: skipped and counted by the main path
    t = m.groups
    if t is None:
        if gi == 0 and kind == FULL:
            return False
        t = m.groups = GroupTable(0 if len(m.nodes) else None)
    if t.primary is None and kind == FULL and gi not in t.groups:
        t.primary = gi
    if gi == t.primary:
        if kind == FULL:
            return False
        stats.drop(DROP_GROUP_KIND, len(ev.block_hashes))
        return True
    window = ev.kv_cache_spec_sliding_window if kind == SWA else None
    g = t.groups.get(gi)
    if g is None:
        g = t.groups[gi] = Group(gi, kind, window, m.block_size, m.new_map)
    elif g.kind != kind or g.window != window:
        stats.drop(DROP_GROUP_KIND, len(ev.block_hashes))
        return True
    _group_store(m, w, g, ev, stats)
    return True


def _group_store(m: ModelState, w: WorkerState, g: Group, ev: BlockStored, stats: ApplyStats) -> None:
    hashes = ev.block_hashes
    n = len(hashes)
    medium = parse_medium(ev.medium)
    if medium is None:
        stats.drop("unknown_medium", n)
        return
    mname = MEDIUM_NAMES[medium]
    gext = g.slot_map(w.slot)
    wext = w.ext
    bs = m.block_size
    ntok = len(ev.token_ids) if ev.token_ids else 0
    keys: list[int] = []
    if ev.block_size == 0 or not ntok:
        # Placeholder: a new tier on blocks this worker already maps (in this group or as KV).
        for h in hashes:
            key = gext.get(h)
            if key is None:
                key = wext.get(h)
            if key is None:
                stats.drop(DROP_PLACEHOLDER, n)
                return
            keys.append(key)
    else:
        hashes = full_block_hashes(ev, ntok, bs, stats)
        if not hashes:
            return
        if ev.parent_block_hash is None:
            state: int | None = m.seed(ev.lora_name, ev.cache_salt)
        else:
            state = gext.get(ev.parent_block_hash)
            if state is None:
                state = wext.get(ev.parent_block_hash)
        xk = ev.extra_keys
        toks = ev.token_ids
        for j, h in enumerate(hashes):
            key = gext.get(h)
            if key is None:
                key = wext.get(h)
            if key is None:
                if state is None:
                    stats.drop(DROP_GROUP_ORPHAN, len(hashes) - j)
                    break
                x = 0
                if xk:
                    x = extra_digest(xk[j]) if len(xk) == n else extra_digest(xk)
                try:
                    d = block_digest_py([int(v) for v in toks[j * bs : (j + 1) * bs]], x)
                except (TypeError, ValueError, OverflowError):
                    stats.drop("bad_tokens", len(hashes) - j)
                    break
                key = (state * CHAIN_P + d) & MASK64
            keys.append(key)
            state = key
        hashes = hashes[: len(keys)]
    nodes = g.nodes
    bit = 1 << (w.shift + int(medium))
    counts = [0, 0, 0]
    for h, key in zip(hashes, keys):
        had = gext.get(h)
        gext[h] = key
        r = nodes.get(key, 0)
        if r & bit:
            counts[1] += 1
        else:
            nodes[key] = r | bit
            counts[0 if had is None else 2] += 1
    for outcome, c in zip(STORE_OUTCOMES, counts):
        stats.count(GROUP_STORED, mname, outcome, c)


def route_remove(m: ModelState, w: WorkerState, ev: BlockRemoved, stats: ApplyStats) -> bool:
    """Called for removes with a non-zero group_idx or on a model with groups. True when handled here
    (a non-primary group's remove, or a counted drop); False: the main tree's remove."""
    gi = ev.group_idx
    t = m.groups
    if gi is None or (t is not None and gi == t.primary):
        return False
    g = t.groups.get(gi) if t is not None else None
    if g is None:
        stats.drop(DROP_UNKNOWN_GROUP, len(ev.block_hashes))  # never seen in a store: not the KV's remove
        return True
    medium = parse_medium(ev.medium)
    if medium is None:
        stats.drop("unknown_medium", len(ev.block_hashes))
        return True
    gext = g.ext.get(w.slot)
    nodes = g.nodes
    sh = w.shift
    bit = 1 << (sh + int(medium))
    removed = absent = 0
    for h in ev.block_hashes:
        if gext is not None and unset_tier(nodes, gext, h, bit, sh):
            removed += 1
        else:
            absent += 1
    mname = MEDIUM_NAMES[medium]
    for outcome, c in zip(REMOVE_OUTCOMES, (removed, absent)):
        stats.count(GROUP_REMOVED, mname, outcome, c)
    return True


# --- score -------------------------------------------------------------------------------------
# Consecutive blocks whose full-attention residencies are equal form one run, so the full-attention
# prefix and split cost one step per run and worker (like indexer/core/scoring.py). A window of a
# sliding-window group is judged by its distinct residency values (few: blocks are held in runs).

def _code(r: int, sh: int, pool_bits: int) -> int:
    """The cheapest tier (0 gpu .. 3 shared pool) holding a block for the worker at shift `sh`."""
    own = (r >> sh) & 7
    if own:
        return 0 if own & 1 else 1 if own & 2 else 2
    return 3 if r & pool_bits else ABSENT


def _usable(top: int, parts: list[tuple[int, int | None, list[int]]], sh: int, pool_bits: int, limit: int) -> int:
    """Largest L <= top (the full-attention prefix) at which every sliding-window / Mamba group
    validates an end with tiers <= limit (0: the GPU alone; 3: any tier). L = 0 always."""
    verified: list[int | None] = [None] * len(parts)  # per SWA group: blocks [v, >= L-1] known good
    L = top
    while L > 0:
        for k, (kind, span, vals) in enumerate(parts):
            if kind == MAMBA:
                if _code(vals[L - 1], sh, pool_bits) > limit:
                    L -= 1
                    break
                continue
            lo = 0 if span is None else max(0, L - span)
            v = verified[k]
            hi = L - 1 if v is None else min(L - 1, v - 1)
            if hi >= lo:
                seg = vals[lo : hi + 1]
                bad = {x for x in set(seg) if _code(x, sh, pool_bits) > limit}
                if bad:
                    j = hi
                    while seg[j - lo] not in bad:
                        j -= 1
                    while j and _code(vals[j - 1], sh, pool_bits) > limit:
                        j -= 1  # the whole bad run: no end above its first block can use it
                    verified[k] = None
                    L = j
                    break
            verified[k] = lo if v is None else min(v, lo)
        else:
            return L
    return 0


def score_groups(m: ModelState, keys: list[int], weights: TierWeights, slots: list[WorkerState]) -> ScoreResult:
    """`score_keys` for a model with groups: usable prefixes (module docstring), ranked like it."""
    t = m.groups
    assert t is not None
    main = []
    for r in map(m.nodes.get, keys):  # no worker holds KV past the first absent block
        if r is None:
            break
        main.append(r)
    n = len(main)
    fulls = [main] + [[v or 0 for v in map(g.nodes.get, keys[:n])] for g in t.groups.values() if g.kind == FULL]
    runs = [(vt, len(list(grp))) for vt, grp in groupby(zip(*fulls))]
    parts = [(g.kind, g.span, [v or 0 for v in map(g.nodes.get, keys[:n])]) for g in t.groups.values() if g.kind != FULL]
    pool_bits = m.slot_mask << 3
    wt = weights.as_tuple()
    bs = m.block_size
    out = []
    for w in slots:
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
        kv = pos
        dev = _usable(kv if dev_top < 0 else dev_top, parts, sh, pool_bits, 0)
        cached = _usable(kv, parts, sh, pool_bits, 3)
        split = [0, 0, 0, 0]
        for start, ln, c in coded:
            if start >= cached:
                break
            split[c] += min(ln, cached - start)
        # A block a sliding-window / Mamba group needs at `cached` costs at least that group's tier.
        raised: dict[int, int] = {}
        for kind, span, vals in parts:
            lo = cached - 1 if kind == MAMBA else 0 if span is None else max(0, cached - span)
            if cached == 0 or lo >= cached:
                continue
            codes = {x: _code(x, sh, pool_bits) for x in set(vals[lo:cached])}
            if max(codes.values()) == 0:
                continue  # all on the GPU: costs nothing more than the KV
            for i in range(lo, cached):
                c = codes[vals[i]]
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
    out.sort(key=lambda s: (-s.score, -s.cached_blocks, s.worker_id, s.dp_rank))
    return ScoreResult(query_blocks=len(keys), block_size=bs, workers=out)


# --- dump --------------------------------------------------------------------------------------
# Group state rides in a worker's dump as placeholder-shaped stores whose kind is the dump marker
# plus a letter (no full / sliding / mamba marker in it, so `apply` skips them): one header per
# known group (its kind and window, even when empty), then one store per tier with the engine
# hashes and their content keys in `extra_keys`, like indexer/core/dump.py.

DUMP_GROUP = "kvatlas_dump/"
_LETTERS = "FSM"  # FULL, SWA, MAMBA


def group_heads(t: GroupTable) -> list[BlockStored]:
    """The dump's head events of a model's groups: which groups exist, their kinds and windows."""
    heads = []
    if t.primary is not None:
        heads.append(BlockStored([], None, [], 0, medium="GPU", group_idx=t.primary, kv_cache_spec_kind=DUMP_GROUP + "F"))
    for gi, g in t.groups.items():
        heads.append(BlockStored([], None, [], 0, medium="GPU", group_idx=gi, kv_cache_spec_kind=DUMP_GROUP + _LETTERS[g.kind],
                                 kv_cache_spec_sliding_window=g.window))
    return heads


def is_group_head(e: Any) -> bool:
    """A `group_heads` event."""
    return isinstance(e, BlockStored) and not e.block_hashes and (e.kv_cache_spec_kind or "").startswith(DUMP_GROUP)


def dump_groups(m: ModelState, out: list[tuple[str, int, list[Any]]]) -> None:
    t = m.groups
    if t is None:
        return
    by_id = {(wid, r): evs for wid, r, evs in out}
    heads = group_heads(t)
    for w in m.workers:
        if w is None:
            continue
        evs = by_id.get((w.worker_id, w.dp_rank))
        if evs is None:
            continue
        evs.extend(heads)
        for gi, g in t.groups.items():
            gext = g.ext.get(w.slot)
            if not gext:
                continue
            per_tier: list[tuple[list[Any], list[int]]] = [([], []) for _ in range(4)]
            for h, key in gext.items():
                bits = (g.nodes.get(key, 0) >> w.shift) & NIBBLE
                for tier in range(4):
                    if bits >> tier & 1:
                        per_tier[tier][0].append(h)
                        per_tier[tier][1].append(key)
            for tier, (hs, ks) in enumerate(per_tier):
                if hs:
                    evs.append(BlockStored(hs, None, [], 0, medium=MEDIUM_NAMES[tier], extra_keys=ks, group_idx=gi,
                                           kv_cache_spec_kind=DUMP_GROUP + _LETTERS[g.kind]))


def load_groups(m: ModelState, dump: list[tuple[str, int, list[Any]]]) -> int:
    """The group part of a dump (`dump_groups`) into `m`; returns group entries loaded."""
    loaded = 0
    for worker_id, dp_rank, events in dump:
        for ev in events:
            kind = ev.kv_cache_spec_kind if isinstance(ev, BlockStored) else None
            if not (isinstance(kind, str) and kind.startswith(DUMP_GROUP) and kind[len(DUMP_GROUP):] in _LETTERS):
                continue
            code = _LETTERS.index(kind[len(DUMP_GROUP):])
            gi = ev.group_idx
            if type(gi) is not int or gi < 0 or ev.medium not in MEDIUM_NAMES:
                continue
            t = m.groups
            if t is None:
                t = m.groups = GroupTable(None)
            if code == FULL and t.primary is None and gi not in t.groups:
                t.primary = gi
            if gi == t.primary:
                continue
            g = t.groups.get(gi)
            if g is None:
                win = ev.kv_cache_spec_sliding_window
                g = t.groups[gi] = Group(gi, code, win if type(win) is int else None, m.block_size, m.new_map)
            if not ev.block_hashes:
                continue
            keys = ev.extra_keys or []
            if len(keys) != len(ev.block_hashes):
                continue
            w = m.worker(str(worker_id), int(dp_rank))
            gext = g.slot_map(w.slot)
            bit = 1 << (w.shift + MEDIUM_NAMES.index(ev.medium))
            for h, key in zip(ev.block_hashes, keys):
                if type(key) is not int or not 0 <= key <= MASK64:
                    continue
                gext[h] = key
                g.nodes[key] = g.nodes.get(key, 0) | bit
                loaded += 1
    return loaded
