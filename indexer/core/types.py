"""Result and configuration types of the index core (no logic beyond small helpers)."""
from __future__ import annotations

from typing import Any

import msgspec

from schemas.media import Medium
from schemas.rules import TIER_NAMES  # noqa: F401 — re-exported: the core's tier order

MEDIUM_NAMES: tuple[str, ...] = tuple(m.name for m in Medium)  # indexed by tier (Medium value)

# The `ApplyStats` vocabulary the accelerator also fills (its tables are generated from these,
# indexer/_native/wire.py): outcomes per event type, and the drop reasons its walk can decide.
STORE_OUTCOMES: tuple[str, str, str] = ("new", "duplicate", "tier_added")
REMOVE_OUTCOMES: tuple[str, str] = ("removed", "absent")
CLEARED_KEY: tuple[str, str, str] = ("cleared", "ALL", "cleared")
DROP_NON_FULL = "non_full_attention"
DROP_PLACEHOLDER = "placeholder_unknown"
DROP_BLOCK_SIZE = "block_size_mismatch"
DROP_PARTIAL = "partial_block"
DROP_GROUP_ORPHAN = "group_orphan"  # a group's store whose blocks resolve neither by map nor by parent
ACCEL_DROPS: tuple[str, ...] = (DROP_NON_FULL, DROP_PLACEHOLDER, DROP_BLOCK_SIZE, DROP_PARTIAL, DROP_GROUP_ORPHAN)
# Per-group event counts of hybrid layouts (indexer/core/groups.py), by medium and outcome as above.
GROUP_STORED = "group_stored"
GROUP_REMOVED = "group_removed"


# Drop reasons of a batch whose own dp_rank is refused (`RankLimits`): nothing of it is applied.
DROP_RANK_RANGE = "dp_rank_out_of_range"
DROP_RANK_COUNT = "too_many_ranks"


class RankLimits(msgspec.Struct, frozen=True):
    """Bounds on the dp_ranks a batch may name for itself (`apply_payload(..., rank_from_batch=True)`).

    Every (worker, rank) takes a slot, and a slot widens every node's residency word, so ranks from
    the wire are bounded: at most `max_dp_rank` as a value, and at most `max_ranks_per_worker` ranks
    per worker id (the caller's own rank, e.g. the registered one, is always accepted and counts).
    docs/index-core.md says why these defaults."""

    max_dp_rank: int = 1023
    max_ranks_per_worker: int = 64


class BlockSizeConflict(ValueError):
    """A model namespace was asked for with a block size different from the one it has."""


class TierWeights(msgspec.Struct, frozen=True):
    """Weight of one cached token per tier, used by `score` (defaults favour GPU > host > disk > shared)."""

    gpu: float = 1.0
    host: float = 0.8
    disk: float = 0.5
    shared: float = 0.4

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.gpu, self.host, self.disk, self.shared)


class ApplyStats(msgspec.Struct):
    """What one `apply` did, in blocks.

    counts: (event type, canonical medium, outcome) -> blocks. Outcomes: stored `new`,
    `duplicate`, `tier_added` (placeholder or re-store of a known hash), `orphan_held`,
    `orphan_attached`; removed `removed`, `absent`, `pending_cancelled`; cleared `cleared` (events).
    drops: reason -> blocks (or events for whole-event drops).
    resync_needed: orphans expired, so the worker's view is incomplete and it should be resynced.
    """

    counts: dict[tuple[str, str, str], int] = msgspec.field(default_factory=dict)
    drops: dict[str, int] = msgspec.field(default_factory=dict)
    orphans_pending: int = 0
    orphans_dropped: int = 0
    resync_needed: bool = False
    # Filled by `apply_payload(..., rank_from_batch=True)` only: the rank the batch applied to (None
    # when the payload does not decode), its ts, and its event count (0: a heartbeat, not applied).
    dp_rank: int | None = None
    ts: float = 0.0
    n_events: int = 0

    # Zero adds nothing (an event with no blocks): the accelerator reports only non-zero counts too.
    def count(self, etype: str, medium: str, outcome: str, n: int = 1) -> None:
        if n:
            key = (etype, medium, outcome)
            self.counts[key] = self.counts.get(key, 0) + n

    def drop(self, reason: str, n: int = 1) -> None:
        if n:
            self.drops[reason] = self.drops.get(reason, 0) + n

    def merge(self, other: "ApplyStats") -> None:
        for k, v in other.counts.items():
            self.counts[k] = self.counts.get(k, 0) + v
        for k, v in other.drops.items():
            self.drops[k] = self.drops.get(k, 0) + v
        self.orphans_pending = other.orphans_pending
        self.orphans_dropped += other.orphans_dropped
        self.resync_needed = self.resync_needed or other.resync_needed


class WorkerScore(msgspec.Struct):
    worker_id: str
    dp_rank: int
    device_blocks: int
    cached_blocks: int
    tiers: dict[str, int]
    score: float
    # Models with groups only (indexer/core/groups.py): the full-attention-only match over any tier,
    # while device_blocks / cached_blocks are the usable prefixes. None for full-attention-only models.
    kv_blocks: int | None = None


def holds(row: Any) -> bool:
    """Whether a score row (WorkerScore, or an answer's WorkerScoreOut) holds some of the query: a
    count, a tier's blocks or (hybrid) kv_blocks above 0. The holders' answer keeps these rows."""
    t = row.tiers
    return bool(row.device_blocks or row.cached_blocks or (row.kv_blocks or 0) > 0
                or any((t.values() if type(t) is dict else (t.gpu, t.host, t.disk, t.shared))))


class ScoreResult(msgspec.Struct):
    query_blocks: int
    block_size: int
    workers: list[WorkerScore]


class ScoreTable:
    """A score with its rows packed in C (`score_rows` without a row type): `rows` holds one record
    per scored (worker_id, dp_rank), best first, each naming its position in `worker_ids` / `ranks`
    (the (worker_id, dp_rank)-sorted order the index scored them in). Read only by the C answer writer
    (router_api/answer.py); `KVIndex.score` gives the same score as objects. `kv`: on a model with
    hybrid workers, an int64 per position, that row's kv_blocks (-1: None, a plain worker's); None on a
    full-attention model (no row has kv_blocks)."""

    __slots__ = ("query_blocks", "block_size", "worker_ids", "ranks", "rows", "kv")

    def __init__(self, query_blocks: int, block_size: int, worker_ids: list[str], ranks: list[int],
                 rows: bytes, kv: bytes | None = None) -> None:
        self.query_blocks = query_blocks
        self.block_size = block_size
        self.worker_ids = worker_ids
        self.ranks = ranks
        self.rows = rows
        self.kv = kv


def full_block_hashes(ev: Any, ntok: int, bs: int, stats: ApplyStats) -> list[Any]:
    """The hashes of a self-describing store's full blocks: none when its block size is not the
    model's, and without a trailing block its tokens do not fill (both counted). Shared by the main
    tree and the groups (docs/hybrid.md)."""
    hashes = ev.block_hashes
    n = len(hashes)
    if ev.block_size != bs:
        stats.drop(DROP_BLOCK_SIZE, n)
        return []
    nfull = min(n, ntok // bs)
    if nfull < n:
        stats.drop(DROP_PARTIAL, n - nfull)
        return hashes[:nfull]
    return hashes

