"""A worker-sharded index: n `KVIndex` shards behind the one `indexer.protocol.Index` interface.

Why: the C apply is bound by memory latency, and one thread applies one event at a time. A worker's
residency is its own, so the workers can be split over shards that share no table, and n threads
(the service's ingest pipelines, `--ingest-shards`) can apply into n shards at once on n cores
(docs/service.md, "Ingest shards"; `bench/bench_apply.py --shards`).

Exactness: every call about one worker goes to its shard (`shard_of`, a stable hash of the worker id),
so each shard holds exactly what one index would hold for its workers, in its own worker slots (so
its residency words are only as wide as its share of the fleet needs). A query is scored over a
merged view of the shards' models (`_Merged`), in which shard t's worker l is slot l * n + t: the C
walk reads each worker's nibble from its own shard's value for the key (`score_rows` with a tuple of
tables), the pure core and the hybrid groups read the shards' values spread into that layout and
OR-ed (`_MergedNodes.get`) — so the shared pool (any worker's claim counts for every worker) and the
usable-prefix rules see what one index would. Trust mode is refused with more than one shard: its
first-seen engine-hash map is shared by all the workers of a model.

Concurrency: calls for workers of different shards touch different shards only and may run at the
same time (the C run apply drops the GIL); calls spanning workers (scores, dumps, model changes)
need every shard quiet — the caller's locks arrange that (router_api/locks.py).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from indexer.core.groups import Layout
from indexer.core.state import ModelState, WorkerState
from indexer.core.types import ApplyStats, ScoreResult, ScoreTable
from indexer.index import _SEQ_TYPES, KVIndex
from schemas.events import KVEvent, KVEventBatch
from schemas.rules import NIBBLE, SLOT_BITS, slot_shift

WorkerDump = tuple[str, int, list[KVEvent]]


def _spread(x: int, n: int, t: int) -> int:
    """Shard t's residency value in the merged layout: its worker l's nibble at slot l * n + t."""
    out, sh, step = 0, slot_shift(t), slot_shift(n)
    while x:
        nib = x & NIBBLE
        if nib:
            out |= nib << sh
        x >>= SLOT_BITS
        sh += step
    return out


class _MergedNodes(tuple):
    """The shards' node tables of one model: a tuple for the C walk (`score_rows` reads merged slot s
    as shard s % n's worker s // n), `.get` for the pure core — the shards' values spread into that
    layout and OR-ed, None when no shard holds the key."""

    __slots__ = ()

    def get(self, key: Any, default: Any = None) -> Any:
        v = None
        n = len(self)
        for t, table in enumerate(self):
            x = table.get(key)
            if x is not None:
                x = _spread(x, n, t)
                v = x if v is None else v | x
        return default if v is None else v


class _MergedGroup:
    """One group (group_idx, kind, window) over the shards: what the scoring reads (kind, span, nodes)."""

    __slots__ = ("kind", "span", "nodes")

    def __init__(self, first: Any, tables: list[Any]) -> None:
        self.kind, self.span = first.kind, first.span
        self.nodes = _MergedNodes(tables)  # one per shard (an empty map where the shard lacks the group)


class _MergedGroups:
    """The shards' group tables (hybrid layouts): one merged group per (group_idx, kind, window)."""

    __slots__ = ("classes",)
    # A merged view is rebuilt whenever a shard's table or its version moves (`_Merged` below), so
    # the view itself never changes: the constant version a plan cache keyed on it needs.
    version = 0

    def __init__(self, tables: list[Any]) -> None:
        """`tables`: each shard's GroupTable or None (position = shard)."""
        self.classes: dict[Any, Any] = {}  # _MergedGroup, which a Layout holds where a Group would be
        for key in {k for t in tables if t is not None for k in t.classes}:
            per_shard = [t.classes.get(key) if t is not None else None for t in tables]
            first = next(g for g in per_shard if g is not None)
            self.classes[key] = _MergedGroup(first, [g.nodes if g is not None else {} for g in per_shard])

    def layout(self, lay: Any) -> Layout:
        """A worker's layout over the merged groups."""
        out = Layout(lay.primary)
        out.groups = {gi: self.classes[g.key] for gi, g in lay.groups.items()}
        return out


class _Merged:
    """A read-only view of one model over all shards, with what the scoring reads of a ModelState:
    the shards' workers as stand-ins numbered in the merged layout (slot l of shard t: l * n + t)."""

    __slots__ = ("name", "block_size", "nodes", "workers", "by_id", "slot_mask", "groups", "_ranked", "_first")

    def __init__(self, models: list[ModelState]) -> None:
        first = models[0]
        self._first = first
        self.name = first.name
        self.block_size = first.block_size
        n = len(models)
        self.nodes = _MergedNodes(m.nodes for m in models)
        tables = [m.groups for m in models]
        self.groups = _MergedGroups(tables) if any(t is not None for t in tables) else None
        self.by_id: dict[tuple[str, int], WorkerState] = {}
        self.slot_mask = 0
        for t, m in enumerate(models):
            for k, w in m.by_id.items():
                stand_in = self.by_id[k] = WorkerState(w.worker_id, w.dp_rank, w.slot * n + t, w.ext)
                if w.layout is not None and self.groups is not None:
                    stand_in.layout = self.groups.layout(w.layout)
            self.slot_mask |= _spread(m.slot_mask, n, t)
        self.workers = sorted(self.by_id.values(), key=lambda w: w.slot)
        ws = sorted(self.by_id.values(), key=lambda w: (w.worker_id, w.dp_rank))
        self._ranked = (ws, [w.slot for w in ws], [w.worker_id for w in ws], [w.dp_rank for w in ws])

    def ranked(self) -> tuple[list[WorkerState], list[int], list[str], list[int]]:
        return self._ranked

    def seed(self, lora_name: str | None, cache_salt: str | None) -> int:
        return self._first.seed(lora_name, cache_salt)


class ShardedIndex:
    """`n` KVIndex shards, workers split by id (module docstring)."""

    __slots__ = ("shards", "_views", "_lanes", "_placement", "_placed")

    def __init__(self, n: int = 2, placement: Callable[[str], int] | None = None, **kvindex_kwargs: Any) -> None:
        """`placement(worker_id) -> shard` (default: a stable hash of the id); it must not change its
        answer for a worker while the index lives."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"a sharded index needs at least one shard, got {n!r}")
        if n > 1 and kvindex_kwargs.get("trust_engine_hashes"):
            raise ValueError("trust_engine_hashes cannot be sharded: its first-seen hash map is shared by all "
                             "the workers of a model (use one shard)")
        self.shards = [KVIndex(**kvindex_kwargs) for _ in range(n)]
        # model -> (per shard: the model, its `ranked` cache, its groups and their count, the view was
        # built from; the view)
        self._views: dict[str, tuple[list[Any], _Merged]] = {}
        # model -> (the `_views` entry it was bound to, that view's `table_lane`)
        self._lanes: dict[str, tuple[tuple[list[Any], _Merged], Callable[[Any], ScoreTable | None]]] = {}
        self._placement = placement
        self._placed: dict[str, int] = {}  # worker id -> shard, computed once

    def shard_of(self, worker_id: str) -> int:
        """The shard of a worker (the same for the life of the index; snapshots are routed again on load)."""
        s = self._placed.get(worker_id)
        if s is None:
            if self._placement is not None:
                s = self._placement(worker_id)
                if not isinstance(s, int) or not 0 <= s < len(self.shards):
                    raise ValueError(f"placement({worker_id!r}) = {s!r}: not a shard of {len(self.shards)}")
            else:
                digest = hashlib.blake2b(worker_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
                s = int.from_bytes(digest, "little") % len(self.shards)
            self._placed[worker_id] = s
        return s

    @property
    def shard_count(self) -> int:
        return len(self.shards)

    def _of(self, worker_id: str) -> KVIndex:
        return self.shards[self.shard_of(worker_id)]

    @property
    def native(self) -> bool:
        return all(s.native for s in self.shards)

    # --- namespaces -------------------------------------------------------------------------
    def ensure_model(self, model: str, block_size: int, trust_engine_hashes: bool | None = None) -> None:
        if trust_engine_hashes and len(self.shards) > 1:
            raise ValueError("trust_engine_hashes cannot be sharded (see ShardedIndex)")
        for s in self.shards:
            s.ensure_model(model, block_size, trust_engine_hashes)

    def models(self) -> dict[str, int]:
        return self.shards[0].models()

    def block_size(self, model: str) -> int | None:
        return self.shards[0].block_size(model)

    def drop_model(self, model: str) -> bool:
        return any([s.drop_model(model) for s in self.shards])

    # --- one worker: its shard ----------------------------------------------------------------
    def apply(self, model: str, worker_id: str, dp_rank: int, batch: KVEventBatch) -> ApplyStats:
        return self._of(worker_id).apply(model, worker_id, dp_rank, batch)

    def apply_payload(
        self, model: str, worker_id: str, dp_rank: int, payload: bytes, *, rank_from_batch: bool = False,
    ) -> ApplyStats:
        return self._of(worker_id).apply_payload(model, worker_id, dp_rank, payload, rank_from_batch=rank_from_batch)

    def apply_run(
        self, model: str, worker_id: str, rank: int, default_rank: int, payloads: list[bytes],
    ) -> tuple[int, ApplyStats, ApplyStats | None]:
        return self._of(worker_id).apply_run(model, worker_id, rank, default_rank, payloads)

    def register_worker(self, model: str, worker_id: str, dp_rank: int = 0) -> None:
        self._of(worker_id).register_worker(model, worker_id, dp_rank)

    def clear_worker(self, model: str, worker_id: str, dp_rank: int | None = None) -> int:
        return self._of(worker_id).clear_worker(model, worker_id, dp_rank)

    def remove_worker(self, model: str, worker_id: str, dp_rank: int | None = None) -> int:
        return self._of(worker_id).remove_worker(model, worker_id, dp_rank)

    # --- every worker -------------------------------------------------------------------------
    def workers(self, model: str) -> list[tuple[str, int]]:
        return [k for s in self.shards for k in s.workers(model)]

    def worker_stats(self, model: str) -> dict[tuple[str, int], dict[str, int]]:
        out: dict[tuple[str, int], dict[str, int]] = {}
        for s in self.shards:
            out.update(s.worker_stats(model))
        return out

    def _fresh(self, model: str, sig: list[Any]) -> bool:
        """Whether the shards' `model` is still what `sig` (a view's) was taken from: `_view`'s test,
        written as one loop over the shards' own tables, for the per-query path (each call and
        comprehension is paid again on every /score, with cold caches on a busy host)."""
        for s, (m0, r0, g0, v0) in zip(self.shards, sig):
            m = s._models.get(model)  # (the shards are this index's own KVIndex objects)
            if m is not m0 or m._ranked is not r0 or m.groups is not g0 or (g0 is not None and g0.version != v0):
                return False  # (an unbuilt `ranked` cache is None: never the view's)
        return True

    def _view(self, model: str) -> _Merged:
        """The merged view of `model`, rebuilt when a shard's model, membership or groups changed."""
        hit = self._views.get(model)
        if hit is not None and self._fresh(model, hit[0]):
            return hit[1]
        ms = [s.model_state(model) for s in self.shards]
        # identities: the model objects (load_dump replaces them), their `ranked` caches (reset on every
        # membership change) and group tables (a table appears with a model's first layout; its version
        # moves with every layout change)
        sig = [(m, m.ranked(), m.groups, m.groups.version if m.groups is not None else 0) for m in ms]
        view = _Merged(ms)
        self._views[model] = (sig, view)
        return view

    def score(
        self, model: str, token_ids: Sequence[int] | np.ndarray, lora_name: str | None = None,
        cache_salt: str | None = None, workers: Iterable[tuple[str, int]] | None = None,
        extra_keys: Sequence[Any] | None = None, holders: bool = False,
    ) -> ScoreResult:
        return self.shards[0].score_model(self._view(model), token_ids, lora_name, cache_salt, workers, extra_keys,
                                          holders)

    def score_table(
        self, model: str, token_ids: Sequence[int] | np.ndarray, lora_name: str | None = None,
        cache_salt: str | None = None, workers: Iterable[tuple[str, int]] | None = None, holders: bool = False,
    ) -> ScoreTable | None:
        """Every row packed, `holders` or not (the answer writer's holders form filters them)."""
        if workers is None and lora_name is None and cache_salt is None and type(token_ids) in _SEQ_TYPES:
            # every /score of the service: the view's bound C call while the view holds (`table_lane`)
            hit = self._lanes.get(model)
            if hit is not None and hit[0] is self._views.get(model) and self._fresh(model, hit[0][0]):
                return hit[1](token_ids)
            view = self._view(model)
            lane = self.shards[0].table_lane(view)
            if lane is None:
                self._lanes.pop(model, None)
            else:
                self._lanes[model] = (self._views[model], lane)
                return lane(token_ids)
        return self.shards[0].score_table_model(self._view(model), token_ids, lora_name, cache_salt, workers)

    def score_keys(self, model: str, keys: list[int], workers: Iterable[tuple[str, int]] | None = None) -> ScoreResult:
        return self.shards[0].score_keys_model(self._view(model), keys, workers)

    def query_keys(
        self, model: str, token_ids: Sequence[int] | np.ndarray, lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        return self.shards[0].query_keys(model, token_ids, lora_name, cache_salt)

    # --- snapshots ----------------------------------------------------------------------------
    def dump(self, model: str) -> list[WorkerDump]:
        """The shards' dumps together (each worker's entry carries its own layout)."""
        return [d for s in self.shards for d in s.dump(model)]

    def load_dump(self, model: str, block_size: int, dump: list[WorkerDump]) -> int:
        """Each worker's entry into its shard (every shard's model is replaced, as with one index)."""
        parts: list[list[WorkerDump]] = [[] for _ in self.shards]
        for d in dump:
            parts[self.shard_of(d[0])].append(d)
        return sum(s.load_dump(model, block_size, p) for s, p in zip(self.shards, parts))

    def num_nodes(self, model: str) -> int:
        """Node entries over the shards (a block held in two shards counts twice)."""
        return sum(s.num_nodes(model) for s in self.shards)
