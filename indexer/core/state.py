"""In-memory state of one model namespace: the content-keyed tree and per-worker maps.

Layout (chosen for speed and size in pure Python):
- `nodes: dict[key -> residency]`. `key` is the chained content state of a block (see
  `indexer.hashing`), which identifies the block *and its whole prefix*, so the tree needs no child
  or parent pointers: a query walks by computing the chain of its own keys and looking each up.
  A node exists exactly while some worker holds it on some tier; a node whose holders are all gone
  is deleted at once (its descendants stay, unreachable until the prefix is stored again, which is
  exactly prefix-match semantics).
- `residency` is one int with 4 bits per worker slot: bit `4*slot + tier` (tier = Medium value:
  GPU 0, CPU_PINNED 1, DISK 2, EXTERNAL 3). The shared pool of a block is the OR of every worker's
  EXTERNAL bit: a pool block is usable by every worker of the model, and it stays in the pool while
  any worker's events still claim it (a claim lives and dies with that worker's ext-hash mapping).
- Per worker `ext: dict[engine hash -> key]`, for parents and removes (engine hashes are scoped
  per (worker, dp_rank)).
- The maps come from `new_map` (a dict by default). With the C accelerator they are its `U64Map`s:
  the same mapping interface with u64 keys and int values stored inline (about 16-24 bytes an entry
  instead of ~100 for a dict slot plus two int objects); bytes engine hashes go to its side dict.
  The core only uses the mapping interface, so it runs unchanged on either (docs/index-core.md).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from indexer.core.types import DROP_RANK_COUNT, DROP_RANK_RANGE, RankLimits
from indexer.hashing import namespace_seed
from schemas.rules import NIBBLE, SLOTS_PER_WORD, slot_shift


class PendingOrphan:
    """A store whose parent is not (yet) known for its worker, waiting a few batches."""

    __slots__ = ("hashes", "parent", "digests", "tier", "medium", "age", "cancelled")

    def __init__(self, hashes: list, parent: Any, digests: list[int], tier: int, medium: str) -> None:
        self.hashes = hashes
        self.parent = parent
        self.digests = digests
        self.tier = tier
        self.medium = medium
        self.age = 0
        self.cancelled: set | None = None


def unset_tier(nodes: Any, ext: Any, h: Any, bit: int, sh: int) -> bool | None:
    """Take one tier bit of one worker off the block its engine hash `h` maps to. None when `h` is
    not mapped, else whether the bit was set. A block left with no tier for that worker loses the
    mapping; a key left with no residency at all leaves the table (main tree and groups alike)."""
    key = ext.get(h)
    if key is None:
        return None
    r = nodes.get(key, 0)
    hit = bool(r & bit)
    r &= ~bit
    if not (r >> sh) & NIBBLE:
        del ext[h]
    if r:
        nodes[key] = r
    elif key in nodes:
        del nodes[key]
    return hit


def clear_bits(nodes: Any, keys: Iterable[Any], sh: int) -> None:
    """Drop one worker's nibble (at shift `sh`) from every key in `keys`. A map with `clear_nibble`
    (the accelerator's U64Map) does it without reading values as whole ints (a holder list's int is as
    wide as the fleet) and leaves this loop the keys it does not hold inline."""
    fast = getattr(nodes, "clear_nibble", None)
    if fast is not None:
        keys = fast(keys, sh)
    keep = ~(NIBBLE << sh)
    for key in keys:
        r = nodes.get(key)
        if r is None:
            continue
        r &= keep
        if r:
            nodes[key] = r
        else:
            del nodes[key]


def move_bits(nodes: Any, keys: Iterable[Any], old: int, new: int) -> None:
    """Move one worker's nibble from shift `old` to the free shift `new` on every key in `keys`
    (`move_nibble`: as `clear_bits`' `clear_nibble`)."""
    fast = getattr(nodes, "move_nibble", None)
    if fast is not None:
        keys = fast(keys, old, new)
    keep = ~(NIBBLE << old)
    for key in keys:
        r = nodes.get(key)
        if r is not None:
            nodes[key] = (r & keep) | (((r >> old) & NIBBLE) << new)


class WorkerState:
    __slots__ = ("worker_id", "dp_rank", "slot", "shift", "ext", "pending", "layout")

    def __init__(self, worker_id: str, dp_rank: int, slot: int, ext: Any) -> None:
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.slot = slot
        self.shift = slot_shift(slot)
        self.ext: dict[Any, int] = ext
        self.pending: list[PendingOrphan] = []
        self.layout: Any = None  # its groups (a groups.Layout) once one of its stores names a group


class ModelState:
    __slots__ = (
        "name", "block_size", "trust", "nodes", "workers", "by_id", "free_slots",
        "slot_mask", "live_gpu", "seeds", "seed0", "known_ext", "new_map", "new_churn_map", "_ranked", "groups", "ranks",
    )

    def __init__(
        self, name: str, block_size: int, trust: bool, new_map: Callable[[], Any] = dict,
        new_nodes: Callable[[], Any] | None = None, new_churn_map: Callable[[], Any] | None = None,
    ) -> None:
        self.name = name
        self.block_size = block_size
        self.trust = trust
        self.new_map = new_map  # an empty key -> non-negative int map: dict, or the accelerator's U64Map
        # the main tree's map: `new_map`'s, or one whose storage follows each node's holders
        # (U64Map.holders: holder lists past 128 worker slots); either reads and writes the same ints
        self.nodes: dict[int, int] = (new_nodes or new_map)()
        # a sliding-window or Mamba group's map: its blocks come and go with every chunk (U64Map.sparse:
        # kept sparser, so probes and deletes stay short), else `new_map`'s
        self.new_churn_map = new_churn_map or new_map
        self.workers: list[WorkerState | None] = []
        self.by_id: dict[tuple[str, int], WorkerState] = {}
        self.free_slots: list[int] = []
        self.slot_mask = 0  # bit 4*s set for every allocated slot s (live or free)
        self.live_gpu = 0  # bit 4*s set for every live slot s
        self.seeds: dict[tuple[str | None, str | None], int] = {}
        self.seed0 = self.seed(None, None)  # the namespace without LoRA or salt (the hot path's)
        # trust mode: first-seen engine hash -> key, shared by all workers of the model
        self.known_ext: dict[Any, int] = self.new_map()
        self._ranked: tuple[list[WorkerState], list[int], list[str], list[int]] | None = None
        self.groups: Any = None  # the groups of the workers' layouts, a GroupTable (indexer/core/groups.py)
        self.ranks: dict[str, list[int]] = {}  # worker_id -> its ranks, oldest first (RankLimits; no pass over by_id)

    def ranked(self) -> tuple[list[WorkerState], list[int], list[str], list[int]]:
        """Live workers in (worker_id, dp_rank) order (the scoring tie-break) with their slots, ids and
        ranks as lists; cached until a worker is added or removed."""
        r = self._ranked
        if r is None:
            ws = sorted(self.by_id.values(), key=lambda w: (w.worker_id, w.dp_rank))
            r = self._ranked = (ws, [w.slot for w in ws], [w.worker_id for w in ws], [w.dp_rank for w in ws])
        return r

    def seed(self, lora_name: str | None, cache_salt: str | None) -> int:
        k = (lora_name, cache_salt)
        s = self.seeds.get(k)
        if s is None:
            s = self.seeds[k] = namespace_seed(self.block_size, lora_name, cache_salt)
        return s

    def worker(self, worker_id: str, dp_rank: int) -> WorkerState:
        w = self.by_id.get((worker_id, dp_rank))
        if w is None:
            if self.free_slots:
                slot = min(self.free_slots)
                self.free_slots.remove(slot)
            else:
                slot = len(self.workers)
                self.workers.append(None)
                self.slot_mask |= 1 << slot_shift(slot)
            w = WorkerState(worker_id, dp_rank, slot, self.new_map())
            self.workers[slot] = w
            self.by_id[(worker_id, dp_rank)] = w
            self.ranks.setdefault(worker_id, []).append(dp_rank)
            self.live_gpu |= 1 << slot_shift(slot)
            self._ranked = None
        return w

    def clear(self, w: WorkerState) -> int:
        """Drop every block of one worker on every tier (its groups' too; its layout stays)."""
        clear_bits(self.nodes, set(w.ext.values()), w.shift)
        if w.layout is not None:
            for g in w.layout.groups.values():
                g.clear_slot(w.slot)
            self.groups.version += 1  # its group maps are new ones
        n = len(w.ext)
        w.ext = self.new_map()
        w.pending = []
        return n

    def refuses(self, worker_id: str, rank: int, default: int, limits: RankLimits) -> str | None:
        """Why a batch of `worker_id` may not open `rank` for itself (a drop reason), or None."""
        if rank == default or (worker_id, rank) in self.by_id:
            return None
        if rank > limits.max_dp_rank:
            return DROP_RANK_RANGE
        if len(self.ranks.get(worker_id, ())) >= limits.max_ranks_per_worker:
            return DROP_RANK_COUNT
        return None

    def remove(self, w: WorkerState) -> None:
        self.clear(w)
        if w.layout is not None:
            self.groups.leave(w)  # its layout goes with it (groups no other worker uses too)
        del self.by_id[(w.worker_id, w.dp_rank)]
        ranks = self.ranks[w.worker_id]
        ranks.remove(w.dp_rank)
        if not ranks:
            del self.ranks[w.worker_id]
        self.workers[w.slot] = None
        self.free_slots.append(w.slot)
        self.live_gpu &= ~(1 << w.shift)
        self._ranked = None
        self._compact()

    def _compact(self) -> None:
        """Keep slots dense, so residency values are only as wide as the live workers need: trailing
        free slots go, and while the highest live slot lies in a 64-bit word the live count does not
        need, its worker moves to the lowest free slot (cost: that worker's blocks, paid only when a
        word is freed by it)."""
        words = max(1, -(-len(self.by_id) // SLOTS_PER_WORD))
        while True:
            while self.workers and self.workers[-1] is None:
                top = len(self.workers) - 1
                self.workers.pop()
                self.free_slots.remove(top)
                self.slot_mask &= ~(1 << slot_shift(top))
            top = len(self.workers) - 1
            if top < words * SLOTS_PER_WORD or not self.free_slots:
                return
            w = self.workers[top]
            assert w is not None
            self._move(w, min(self.free_slots))

    def _move(self, w: WorkerState, slot: int) -> None:
        old, new = w.shift, slot_shift(slot)
        move_bits(self.nodes, set(w.ext.values()), old, new)
        if w.layout is not None:
            for g in w.layout.groups.values():
                g.move_slot(w.slot, slot)
        self.free_slots.remove(slot)
        self.free_slots.append(w.slot)
        self.workers[slot] = w
        self.workers[w.slot] = None
        self.live_gpu = (self.live_gpu & ~(1 << old)) | (1 << new)
        w.slot, w.shift = slot, new
        self._ranked = None

    def tier_counts(self, w: WorkerState) -> list[int]:
        """Blocks per tier (gpu, host, disk, shared-claims) held by one worker."""
        counts = [0, 0, 0, 0]
        nodes = self.nodes
        sh = w.shift
        for key in set(w.ext.values()):
            bits = (nodes.get(key, 0) >> sh) & NIBBLE
            for t in range(4):
                if bits >> t & 1:
                    counts[t] += 1
        return counts
