"""Per-group residency for hybrid models (vLLM's group shape; docs/hybrid.md, "The indexer").

A worker's events only ever change that worker's rows, so the group *layout* (which group_idx is
the main tree, which are sliding-window / Mamba / further full-attention groups, their windows) is
learned per worker and dp rank (`Layout`, on its `WorkerState`), from its own stores:
- The *primary* group is the worker's main tree (`ModelState.nodes`, the worker's `ext`): group 0 /
  no group_idx when the worker already holds blocks, else the first full-attention group it names.
- Every other group of a layout is a `Group`: residency per content key (4 tier bits per slot, the
  same layout as the main tree) and per worker its own `engine hash -> key` map. Workers whose
  layouts agree on a group (same group_idx, kind and window) share one `Group` (one lookup per key
  scores all of them); the model's `GroupTable` holds them and drops one its last worker leaves.
- A store that contradicts the worker's layout (another kind or window for a group it knows, a
  non-full store for its main group) is an engine restarted with another model configuration: the
  worker is reset (every block of it cleared, its layout forgotten), counted as
  `("layout", "ALL", "reset")` (not a "cleared" count: the engine sent no clear, and the service
  reads those as a stream rebuilding itself), and the store is learned afresh. Other workers are never touched.
- A worker id may use at most `GROUP_CAP` distinct groups over all its ranks (real hybrid models
  have a handful); a store that would open another is dropped and counted (`group_limit`), which
  bounds the cost one publisher adds to a score.
- A group's store resolves its blocks through its own map, then the worker's main map (the KV block
  with the same hash), then by hashing its tokens from a resolvable parent; anything else is counted
  and dropped. Removes apply to their own group only; a remove for a group the worker never stored
  in is counted (`unknown_group`) and ignored.
Scoring lives in `indexer/core/groupscore.py`, dumps in `indexer/core/groupdump.py`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from indexer.core.state import clear_bits, move_bits, unset_tier
from indexer.core.types import (
    DROP_GROUP_ORPHAN, DROP_PLACEHOLDER, GROUP_REMOVED, GROUP_STORED, MEDIUM_NAMES, REMOVE_OUTCOMES,
    STORE_OUTCOMES, ApplyStats, full_block_hashes,
)
from indexer.hashing import CHAIN_P, MASK64, block_digest_py, extra_digest
from schemas.events import BlockRemoved, BlockStored, is_full_attention
from schemas.media import parse_medium
from schemas.rules import slot_shift, window_blocks

if TYPE_CHECKING:
    from indexer.core.state import ModelState, WorkerState

FULL, SWA, MAMBA = 0, 1, 2
KIND_NAMES = ("full_attention", "sliding_window", "mamba")

GROUP_CAP = 16  # distinct groups one worker id may use over its ranks

DROP_UNKNOWN_GROUP = "unknown_group"
DROP_GROUP_LIMIT = "group_limit"
LAYOUT_RESET_KEY: tuple[str, str, str] = ("layout", "ALL", "reset")

ClassKey = tuple[int, int, "int | None"]  # (group_idx, kind, window)


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
    """One group shared by the workers whose layouts agree on it: residency per content key, and
    per worker slot its map."""

    __slots__ = ("idx", "kind", "window", "span", "nodes", "ext", "new_map", "users")

    def __init__(self, idx: int, kind: int, window: int | None, block_size: int, new_map: Callable[[], Any]) -> None:
        self.idx = idx
        self.kind = kind
        self.window = window
        self.span = window_span(window, block_size) if kind == SWA else None
        self.new_map = new_map
        self.nodes: Any = new_map()
        self.ext: dict[int, Any] = {}  # slot -> (engine hash -> key)
        self.users = 0  # layouts naming this group

    @property
    def key(self) -> ClassKey:
        return (self.idx, self.kind, self.window)

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
        move_bits(self.nodes, set(ext.values()), slot_shift(old), slot_shift(new))


class Layout:
    """One worker's (one dp rank's) groups: its main tree's group_idx and its other groups."""

    __slots__ = ("primary", "groups", "accel", "accel_at", "accel_slot", "learn")

    def __init__(self, primary: int | None) -> None:
        self.primary = primary  # None until a full-attention group is seen (or the worker held KV first)
        self.groups: dict[int, Group] = {}
        # The C walk's view of this layout (indexer/core/accel.py): the groups tuple, built at group
        # table version `accel_at` for slot `accel_slot` (a version bump, i.e. a layout or a group map
        # changed, or a slot move makes it stale), and its learn callback.
        self.accel: tuple | None = None
        self.accel_at = -1
        self.accel_slot = -1
        self.learn: Callable[[int, int, int | None], tuple | None] | None = None

    @property
    def hybrid(self) -> bool:
        return bool(self.groups)


class GroupTable:
    """A model's groups, shared by the layouts that agree on them, and each worker id's share."""

    __slots__ = ("classes", "by_worker", "version")

    def __init__(self) -> None:
        self.classes: dict[ClassKey, Group] = {}
        self.by_worker: dict[str, dict[ClassKey, int]] = {}  # worker id -> group -> its ranks using it
        self.version = 0  # bumped whenever a layout or a worker's group map changes (views over layouts check it)

    def join(self, m: ModelState, w: WorkerState, gi: int, kind: int, window: int | None) -> Group | None:
        """The group (gi, kind, window) added to `w`'s layout; None when its worker id is at the cap."""
        key = (gi, kind, window)
        mine = self.by_worker.setdefault(w.worker_id, {})
        if key not in mine and len(mine) >= GROUP_CAP:
            return None
        g = self.classes.get(key)
        if g is None:
            g = self.classes[key] = Group(gi, kind, window, m.block_size, m.new_map if kind == FULL else m.new_churn_map)
        mine[key] = mine.get(key, 0) + 1
        g.users += 1
        assert w.layout is not None
        w.layout.groups[gi] = g
        self.version += 1
        return g

    def leave(self, w: WorkerState) -> None:
        """Forget `w`'s layout: its residency in every group goes, and groups nobody uses go."""
        lay = w.layout
        w.layout = None
        self.version += 1
        if lay is None:
            return
        mine = self.by_worker.get(w.worker_id, {})
        for g in lay.groups.values():
            g.clear_slot(w.slot)
            key = g.key
            n = mine.get(key, 0) - 1
            if n > 0:
                mine[key] = n
            else:
                mine.pop(key, None)
            g.users -= 1
            if g.users <= 0:
                self.classes.pop(key, None)
        if not mine:
            self.by_worker.pop(w.worker_id, None)


def table(m: ModelState) -> GroupTable:
    t = m.groups
    if t is None:
        t = m.groups = GroupTable()
    return t


def hybrid_workers(ws: list[WorkerState]) -> bool:
    """Whether any of these workers has groups beside its main tree (then scores are usable prefixes)."""
    for w in ws:
        lay = w.layout
        if lay is not None and lay.groups:
            return True
    return False


def reset_layout(m: ModelState, w: WorkerState, stats: ApplyStats) -> None:
    """The worker's engine changed its layout: every block of it goes, and its layout (counted)."""
    m.clear(w)
    table(m).leave(w)
    stats.count(*LAYOUT_RESET_KEY)


# --- apply -------------------------------------------------------------------------------------

def route_store(m: ModelState, w: WorkerState, ev: BlockStored, stats: ApplyStats) -> bool:
    """Called for stores carrying a group_idx. True when handled here (a non-primary group's store or
    a counted drop); False: the main path applies (or skips) it as before."""
    gi = ev.group_idx
    kind = classify(ev.kv_cache_spec_kind)
    if kind is None or type(gi) is not int or gi < 0:
        return False  # not a modelled group: skipped and counted by the main path
    window = ev.kv_cache_spec_sliding_window if kind == SWA else None
    lay = w.layout
    if lay is not None:
        g = lay.groups.get(gi)
        if (gi == lay.primary and kind != FULL) or (g is not None and (g.kind != kind or g.window != window)):
            reset_layout(m, w, stats)  # another layout than the one this worker declared: its state goes
            lay = None
    if lay is None:
        if gi == 0 and kind == FULL:
            return False
        lay = w.layout = Layout(0 if len(w.ext) else None)
        table(m).version += 1
    if lay.primary is None and kind == FULL and gi not in lay.groups:
        lay.primary = gi
        table(m).version += 1
    if gi == lay.primary:
        return False
    g = lay.groups.get(gi)
    if g is None:
        g = table(m).join(m, w, gi, kind, window)
        if g is None:
            stats.drop(DROP_GROUP_LIMIT, len(ev.block_hashes))
            return True
    _group_store(m, w, g, ev, stats)
    return True


def learn_store(m: ModelState, w: WorkerState, gi: int, kind: int, window: int | None) -> bool:
    """`route_store`'s layout step for a store of group `gi` >= 1 (kind FULL / SWA / MAMBA, its
    window for SWA) outside the worker's layout, for the C walk (groups_apply.c), which applies the
    store itself when this returns True: the group was added to a layout whose main tree is group 0
    (or the worker, holding KV, got that layout with this group). False: nothing changed (a
    conflicting group, a main tree not yet known, the group cap), the pure core takes the event."""
    lay = w.layout
    if lay is None:
        if not len(w.ext):
            return False  # its main tree is not known yet: route_store decides
    elif lay.primary != 0 or gi in lay.groups:
        return False  # a conflicting kind or window is a reset: route_store's
    key = (gi, kind, window if kind == SWA else None)
    t = table(m)
    mine = t.by_worker.get(w.worker_id, {})
    if key not in mine and len(mine) >= GROUP_CAP:
        return False  # counted by route_store
    if lay is None:
        w.layout = Layout(0)
        t.version += 1
    return t.join(m, w, gi, kind, key[2]) is not None


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
    """Called for removes with a non-zero group_idx or of a worker with a layout. True when handled
    here (a non-primary group's remove, or a counted drop); False: the main tree's remove."""
    gi = ev.group_idx
    lay = w.layout
    if gi is None or (lay is not None and gi == lay.primary):
        return False
    g = lay.groups.get(gi) if lay is not None else None
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
