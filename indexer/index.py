"""The global KV index: per model namespace, a content-keyed radix tree with per-worker tier residency.

Semantics (design §4/§5; details decided here):
- Namespaces: one per model name, with one block size. LoRA name and cache salt seed the content
  hash, so their blocks never match another namespace's queries. vLLM `extra_keys` are part of a
  block's identity: such blocks are only matched by a query that passes the same extra keys.
- Content key: our own chained hash of each block's token ids (`indexer.hashing`, the single
  function used for stores and queries). `parent_block_hash` is an engine hash of the same
  (worker, dp_rank); the new block's chain continues from that parent's key.
- Unknown parent: the store is held as an orphan for `orphan_grace_batches` further batches of that
  worker (it attaches if the parent arrives, e.g. reordered delivery), then it is dropped, counted in
  `ApplyStats.orphans_dropped` and `resync_needed` is set — never attached to the wrong place.
- A store on tier T for an engine hash already mapped for the worker adds tier T to that block
  (placeholder stores — block_size 0 or no tokens — rely on it; a placeholder naming any unknown
  hash is skipped and counted). Stores and removes are idempotent per (worker, tier); removing an
  absent block is counted. When a worker holds a block on no tier any more, its ext-hash mapping
  goes; a block no worker holds is pruned.
- EXTERNAL stores put the block in the model's shared pool (usable by every worker of the model) for
  as long as any worker's events still claim it; the claiming worker's ext mapping is per worker.
- vLLM groups (`group_idx`): each worker (and dp rank) learns its own group layout from its own
  stores, so one worker's events never change another's rows; full-attention, sliding-window and
  Mamba groups each keep their own residency; removes apply to their own group (a group the worker
  never stored in: counted, ignored); a layout change resets that worker (counted); a worker with
  groups scores usable prefixes (indexer/core/groups.py, docs/hybrid.md).
  Stores of other kinds (and non-full stores without a group_idx) are skipped and counted; partial
  trailing blocks are ignored.
- trust_engine_hashes (per model): engines whose hashes are content-deterministic (SGLang, vLLM with
  a fixed seed) repeat the same engine hash for the same prefix on every worker; with trust on, a hash
  first seen (and hashed from its tokens) on one worker is reused for the others without re-hashing.
- Scoring: `device_blocks` = leading blocks on the worker's GPU; `cached_blocks` = leading blocks
  on any of its tiers or in the shared pool; the split assigns each cached block to the cheapest
  tier holding it (gpu < host < disk < shared); score = block_size * sum(weight[tier]).
No I/O, threads or clocks here; callers serialise access.

Implementation: the rules live once, in the pure-Python core (`indexer.core`). The optional C
accelerator (`native=None`, the default, uses it when built unless KVATLAS_PURE_PYTHON=1;
`native=False` forces pure Python) takes two whole calls off it — applying a raw payload and
scoring — through `indexer.core.accel`; both give identical keys, scores and stats
(tests/test_index_conformance.py). docs/index-core.md describes the layout.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from indexer.core import native as _native
from indexer.core.accel import Accelerator, hybrid_args
from indexer.core.apply import apply_events, decode_or_drop, finite_ts
from indexer.core.dump import dump_model, load_model_dump
from indexer.core.groupdump import dump_groups, load_groups
from indexer.core.groupscore import score_groups
from indexer.core.scoring import rank_key, score_keys
from indexer.core.state import WorkerState
from indexer.core.state import ModelState
from indexer.core.types import (
    TIER_NAMES, ApplyStats, BlockSizeConflict, RankLimits, ScoreResult, ScoreTable, TierWeights, WorkerScore, holds,
)
from indexer.hashing import extra_digest, query_keys
from schemas.batchhead import read_head
from schemas.codec import DEFAULT_MAX_PAYLOAD
from schemas.events import KVEvent, KVEventBatch

__all__ = [
    "ApplyStats", "BlockSizeConflict", "KVIndex", "RankLimits", "ScoreResult", "TierWeights", "WorkerScore",
]


# Token containers the native score reads itself; anything else is hashed by the pure path.
_SEQ_TYPES = (list, tuple, np.ndarray)


def _split(m: Any, wl: list[tuple[str, int]] | None) -> tuple[list[WorkerState], list[tuple[str, int]] | None]:
    """The workers of a selection with groups (their rows are usable prefixes) and the others' ids;
    ([], wl) when none has groups."""
    if m.groups is None:
        return [], wl
    ws = list(m.by_id.values()) if wl is None else [w for w in (m.by_id.get((wid, int(r))) for wid, r in wl) if w is not None]
    hybrid = sorted((w for w in ws if w.layout is not None and w.layout.groups), key=lambda w: (w.worker_id, w.dp_rank))
    if not hybrid:
        return [], wl
    return hybrid, [(w.worker_id, w.dp_rank) for w in ws if w.layout is None or not w.layout.groups]


def _selected(m: Any, wl: list[tuple[str, int]] | None) -> list[WorkerState]:
    """The workers a score covers in (worker_id, dp_rank) order: all, or the named ones that exist."""
    if wl is None:
        return m.ranked()[0]
    ws = (m.by_id.get((wid, int(r))) for wid, r in wl)
    return sorted((w for w in ws if w is not None), key=lambda w: (w.worker_id, w.dp_rank))


class KVIndex:
    __slots__ = ("weights", "trust_engine_hashes", "orphan_grace_batches", "rank_limits", "_models", "_accel", "_plans")

    def __init__(
        self,
        weights: TierWeights | None = None,
        trust_engine_hashes: bool = False,
        orphan_grace_batches: int = 4,
        native: bool | None = None,
        rank_limits: RankLimits | None = None,
    ) -> None:
        self.weights = weights or TierWeights()
        self.rank_limits = rank_limits or RankLimits()
        self.trust_engine_hashes = trust_engine_hashes
        self.orphan_grace_batches = orphan_grace_batches
        self._models: dict[str, ModelState] = {}
        # per model object scored without a worker list: its hybrid split and C arguments, kept while
        # its membership (`ranked`) and layouts (groups' version) stay the same
        self._plans: dict[int, tuple] = {}
        mod = _native.select(native)
        self._accel = Accelerator(mod) if mod is not None else None

    @property
    def native(self) -> bool:
        """True when this index runs on the C accelerator, False on the pure-Python reference core."""
        return self._accel is not None

    def _new_model(self, model: str, block_size: int, trust: bool) -> ModelState:
        a = self._accel
        return ModelState(model, block_size, trust, a.new_map, a.new_nodes, a.new_churn_map) if a is not None else \
            ModelState(model, block_size, trust)

    # --- namespaces -------------------------------------------------------------------------
    def ensure_model(self, model: str, block_size: int, trust_engine_hashes: bool | None = None) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        m = self._models.get(model)
        if m is None:
            trust = self.trust_engine_hashes if trust_engine_hashes is None else trust_engine_hashes
            self._models[model] = self._new_model(model, block_size, trust)
        elif m.block_size != block_size:
            raise BlockSizeConflict(f"model {model!r} has block size {m.block_size}, not {block_size}")
        elif trust_engine_hashes is not None:
            m.trust = trust_engine_hashes

    def models(self) -> dict[str, int]:
        # list(...) copies in one step under the GIL: safe without the index lock (/health)
        return {name: m.block_size for name, m in list(self._models.items())}

    def block_size(self, model: str) -> int | None:
        """`models().get(model)` without building the dict (every /score asks)."""
        m = self._models.get(model)
        return None if m is None else m.block_size

    def drop_model(self, model: str) -> bool:
        """Forget a model and everything indexed under it (its last worker left); False if unknown."""
        return self._models.pop(model, None) is not None

    def _model(self, model: str) -> ModelState:
        m = self._models.get(model)
        if m is None:
            raise KeyError(f"unknown model {model!r}; call ensure_model first")
        return m

    def model_state(self, model: str) -> ModelState:
        """The model's state object (KeyError when unknown): what `score_model` and its siblings
        score over, and what a worker-sharded index merges (indexer/sharded.py). Read it under the
        caller's lock; it is not a copy."""
        return self._model(model)

    # --- worker shards (an unsharded index is one shard) -------------------------------------
    @property
    def shard_count(self) -> int:
        return 1

    def shard_of(self, worker_id: str) -> int:
        return 0

    # --- events -----------------------------------------------------------------------------
    def apply(self, model: str, worker_id: str, dp_rank: int, batch: KVEventBatch) -> ApplyStats:
        """Apply one whole batch of one worker. Unknown model -> KeyError (a caller bug, not bad data)."""
        m = self._model(model)
        w = m.worker(worker_id, int(dp_rank or 0))
        stats = ApplyStats()
        events = batch.events if isinstance(batch, KVEventBatch) else None
        if not isinstance(events, list):
            stats.drop("bad_batch")
            return stats
        return apply_events(m, w, events, self.orphan_grace_batches, stats)

    def apply_payload(
        self, model: str, worker_id: str, dp_rank: int, payload: bytes, *, rank_from_batch: bool = False,
    ) -> ApplyStats:
        """Decode + apply one payload. With `rank_from_batch` the batch's own dp_rank decides the worker
        (when it is a non-negative int; else `dp_rank`) and the stats report it with the batch's ts and
        event count; a batch without events is not applied (a heartbeat: its worker is not registered).
        That is exactly `schemas.batchhead.read_head` + `apply_payload`, in one pass over the bytes."""
        m = self._models.get(model) or self._model(model)
        rank = int(dp_rank) if rank_from_batch else int(dp_rank or 0)
        # Group stores are the pure core's (docs/hybrid.md; the C walk declines them, and the batches of
        # a worker whose main tree is not group 0). Above the decoder's size cap the pure path refuses
        # the payload: the C walk must not take it.
        if self._accel is not None and len(payload) <= DEFAULT_MAX_PAYLOAD:
            stats = self._accel.apply_payload(
                m, worker_id, rank, payload, self.orphan_grace_batches, rank_from_batch, self.rank_limits,
            )
            if stats is not None:
                return stats
        if rank_from_batch:
            return self._apply_headed(m, worker_id, rank, payload)
        stats = ApplyStats()
        batch = decode_or_drop(payload, stats)
        return stats if batch is None else self.apply(model, worker_id, rank, batch)

    def apply_run(
        self, model: str, worker_id: str, rank: int, default_rank: int, payloads: list[bytes],
    ) -> tuple[int, ApplyStats, ApplyStats | None]:
        """Consecutive batches of one worker, as `apply_payload(..., rank_from_batch=True)` with
        `default_rank` would apply them one by one, in one call where it can: returns `(k, stats,
        extra)` — payloads[:k] were applied whole, all of rank `rank`, none a heartbeat, none with
        expired orphans, and `stats` sums their counts, drops and events (`ts`: the last finite ts > 0,
        else 0.0). `extra` is not None when payloads[k] was applied too (it met an orphan): its own stats,
        as apply_payload returns them. The caller applies the batch after the run one by one. k may
        be 0 (the pure core, a hybrid model, a worker not yet known or with orphans pending)."""
        m = self._models.get(model) or self._model(model)
        if self._accel is None:
            return 0, ApplyStats(), None
        return self._accel.apply_run(
            m, worker_id, int(rank), int(default_rank), payloads, self.orphan_grace_batches, DEFAULT_MAX_PAYLOAD,
        )

    def _apply_headed(self, m: ModelState, worker_id: str, default: int, payload: bytes) -> ApplyStats:
        """`rank_from_batch` on the pure path: the head read first (rank, ts, heartbeat), then the
        batch decoded and applied; a payload whose head does not read is judged by the full decoder."""
        head = read_head(payload)
        batch: KVEventBatch | None = None
        if head is None or not head.events:
            stats = ApplyStats()
            batch = decode_or_drop(payload, stats)  # a heartbeat is a few bytes: accepted exactly when this accepts it
            if batch is None:
                return stats
            ts, raw, n = batch.ts, batch.data_parallel_rank, len(batch.events)
        else:
            ts, raw, n = head.ts, head.data_parallel_rank, len(head.events)
        ts = finite_ts(ts)
        rank = raw if raw is not None and raw >= 0 else default
        refused = m.refuses(worker_id, rank, default, self.rank_limits)
        if refused is not None:  # nothing applied, no worker made; a heartbeat reports no rank
            return ApplyStats(drops={refused: n} if n else {}, ts=ts, n_events=n)
        if not n:
            return ApplyStats(dp_rank=rank, ts=ts)
        if batch is None:
            stats = ApplyStats(dp_rank=rank, ts=ts, n_events=n)
            batch = decode_or_drop(payload, stats)
            if batch is None:
                return stats
        stats = self.apply(m.name, worker_id, rank, batch)
        stats.dp_rank, stats.ts, stats.n_events = rank, ts, n
        return stats

    # --- worker lifecycle -------------------------------------------------------------------
    def _select(self, m: ModelState, worker_id: str, dp_rank: int | None) -> list:
        # the worker's own ranks (`ModelState.ranks`), not a pass over the fleet
        return [m.by_id[(worker_id, r)] for r in list(m.ranks.get(worker_id, ())) if dp_rank is None or r == dp_rank]

    def register_worker(self, model: str, worker_id: str, dp_rank: int = 0) -> None:
        """Make a worker known (scored, listed) before its first event."""
        self._model(model).worker(worker_id, int(dp_rank))

    def clear_worker(self, model: str, worker_id: str, dp_rank: int | None = None) -> int:
        m = self._model(model)
        return sum(m.clear(w) for w in self._select(m, worker_id, dp_rank))

    def remove_worker(self, model: str, worker_id: str, dp_rank: int | None = None) -> int:
        m = self._model(model)
        n = 0
        for w in self._select(m, worker_id, dp_rank):
            n += len(w.ext)
            m.remove(w)
        if self._accel is not None:
            self._accel.narrow(m)  # the slots were compacted: residency words may be narrower now
        return n

    def workers(self, model: str) -> list[tuple[str, int]]:
        return list(self._model(model).by_id)

    def worker_stats(self, model: str) -> dict[tuple[str, int], dict[str, int]]:
        m = self._model(model)
        count = m.tier_counts if self._accel is None else (lambda w: self._accel.tier_counts(m, w))
        return {k: dict(zip(TIER_NAMES, count(w))) for k, w in m.by_id.items()}

    # --- scoring ----------------------------------------------------------------------------
    def score(
        self,
        model: str,
        token_ids: Sequence[int] | np.ndarray,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        workers: Iterable[tuple[str, int]] | None = None,
        extra_keys: Sequence[Any] | None = None,
        holders: bool = False,
    ) -> ScoreResult:
        """Score a token sequence. `extra_keys`: per full block, that block's vLLM extra keys or None.
        Workers with groups beside their main tree (hybrid layouts) score usable prefixes. `holders`:
        only the rows that hold some of the query (`holds`), in the same order: what a wide fleet's
        answer is made of (the walk then costs what the query's holders cost, not the fleet's width)."""
        return self.score_model(self._model(model), token_ids, lora_name, cache_salt, workers, extra_keys, holders)

    def score_model(
        self, m: Any, token_ids: Sequence[int] | np.ndarray, lora_name: str | None, cache_salt: str | None,
        workers: Iterable[tuple[str, int]] | None, extra_keys: Sequence[Any] | None, holders: bool = False,
    ) -> ScoreResult:
        """`score` over a model object: this index's own, or a worker-sharded index's merged view of
        its shards' models (indexer/sharded.py)."""
        if holders:
            if (self._accel is not None and not extra_keys and workers is None and m.groups is None
                    and type(token_ids) in _SEQ_TYPES):
                got = self._accel.holder_rows(m, token_ids, m.seed(lora_name, cache_salt), self.weights, WorkerScore)
                if got is not None:
                    return ScoreResult(query_blocks=got[0], block_size=m.block_size, workers=got[1])
            whole = self.score_model(m, token_ids, lora_name, cache_salt, workers, extra_keys)
            whole.workers = [w for w in whole.workers if holds(w)]
            return whole
        extras = [extra_digest(x) for x in extra_keys] if extra_keys else None
        wl = list(workers) if workers is not None else None
        hybrid, plain, args = self._plan(m, wl)
        if hybrid:
            if extras is None and type(token_ids) in _SEQ_TYPES:
                res = self._score_mixed(m, None, token_ids, m.seed(lora_name, cache_salt), hybrid, plain, args)
                if res is not None:
                    return res
            res = self._score_mixed(m, self._keys(m, token_ids, lora_name, cache_salt, extras), None, 0, hybrid, plain, args)
            assert res is not None
            return res
        if self._accel is not None and extras is None and type(token_ids) in _SEQ_TYPES:
            res = self._accel.score(m, None, token_ids, m.seed(lora_name, cache_salt), self.weights, wl)
            if res is not None:
                return res
        keys = self._keys(m, token_ids, lora_name, cache_salt, extras)
        return score_keys(m, keys, self.weights, wl)

    def _plan(self, m: Any, wl: list[tuple[str, int]] | None) -> tuple[list[WorkerState], Any, tuple | None]:
        """`_split`, and with the accelerator and some hybrid worker the C arguments of every selected
        worker (`hybrid_args`: plain ones with an empty layout), so the whole fleet is hashed and walked
        in one call whatever its mix; kept per model object for scores of every worker (the common
        case) until its membership or a layout changes."""
        if wl is not None or m.groups is None or self._accel is None:
            hybrid, plain = _split(m, wl)
            return hybrid, plain, hybrid_args(_selected(m, wl)) if hybrid and self._accel is not None else None
        ranked = m.ranked()
        version = m.groups.version  # (m.groups is not None here)
        hit = self._plans.get(id(m))
        if hit is not None and hit[0] is m and hit[1] is ranked and hit[2] == version:
            return hit[3], hit[4], hit[5]
        hybrid, plain = _split(m, None)
        args = hybrid_args(ranked[0]) if hybrid else None
        if len(self._plans) > 256:  # models come and go: start afresh rather than grow
            self._plans.clear()
        self._plans[id(m)] = (m, ranked, version, hybrid, plain, args)
        return hybrid, plain, args

    def _score_mixed(
        self, m: Any, keys: list[int] | None, tokens: object, seed: int, hybrid: list[WorkerState],
        plain: list[tuple[str, int]] | None, args: tuple | None = None,
    ) -> ScoreResult | None:
        """Workers with groups score usable prefixes, the others as full-attention ones: in one C call
        over every worker (`args`, from `_plan`) where it serves, else the pure core; each row is what
        that worker's own events make of it. Keys come hashed from `tokens` when `keys` is None; then
        None when the C call cannot judge them."""
        if self._accel is not None and args is not None:
            res = self._accel.hybrid_score(m, keys, tokens, seed, self.weights, hybrid, args)
            if res is not None:
                return res
        if keys is None:
            return None
        rows = score_keys(m, keys, self.weights, plain).workers if plain else []
        rows += score_groups(m, keys, self.weights, hybrid)
        rows.sort(key=rank_key)
        return ScoreResult(query_blocks=len(keys), block_size=m.block_size, workers=rows)

    def score_table(
        self, model: str, token_ids: Sequence[int] | np.ndarray, lora_name: str | None = None,
        cache_salt: str | None = None, workers: Iterable[tuple[str, int]] | None = None, holders: bool = False,
    ) -> ScoreTable | None:
        """`score` with the rows packed for a C answer writer (no object per row), or None where only
        `score` serves: no accelerator, tokens the C call does not take (a hybrid model's rows carry their
        kv_blocks column, `ScoreTable.kv`)."""
        if self._accel is None or type(token_ids) not in _SEQ_TYPES:
            return None
        return self.score_table_model(self._model(model), token_ids, lora_name, cache_salt, workers, holders)

    def table_lane(self, m: Any) -> Callable[[Any], ScoreTable | None] | None:
        """`score_table_model(m, tokens, None, None, None)` for u32 / int token containers, bound to `m`
        as it is now (valid while `m`'s membership, groups and identity are unchanged: the caller
        checks); None where that call takes another path (no accelerator, a model with groups)."""
        if self._accel is None or m.groups is not None:
            return None
        return self._accel.table_lane(m, m.seed(None, None), self.weights)

    def score_table_model(
        self, m: Any, token_ids: Sequence[int] | np.ndarray, lora_name: str | None, cache_salt: str | None,
        workers: Iterable[tuple[str, int]] | None, holders: bool = False,
    ) -> ScoreTable | None:
        """`score_table` over a model object (see `score_model`). `holders`: the rows may be only those
        that hold something (where the holders' walk serves; else every row: the answer writer's holders
        form filters either the same way); `worker_ids` / `ranks` are the whole order either way."""
        if self._accel is None or type(token_ids) not in _SEQ_TYPES:
            return None
        if holders and workers is None and m.groups is None:
            got = self._accel.holder_rows(m, token_ids, m.seed(lora_name, cache_salt), self.weights, None)
            if got is not None:
                return ScoreTable(got[0], m.block_size, got[2], got[3], got[1])
        wl = list(workers) if workers is not None else None
        hybrid, _, args = self._plan(m, wl)
        if hybrid:  # every worker's row in one C call, with the kv_blocks column
            return self._accel.hybrid_table(m, token_ids, m.seed(lora_name, cache_salt), self.weights, hybrid, args)
        return self._accel.score_table(m, token_ids, m.seed(lora_name, cache_salt), self.weights, wl)

    def score_keys(self, model: str, keys: list[int], workers: Iterable[tuple[str, int]] | None = None) -> ScoreResult:
        """Score pre-hashed blocks (keys from `indexer.hashing.query_keys`)."""
        return self.score_keys_model(self._model(model), keys, workers)

    def score_keys_model(self, m: Any, keys: list[int], workers: Iterable[tuple[str, int]] | None = None) -> ScoreResult:
        """`score_keys` over a model object (see `score_model`)."""
        wl = list(workers) if workers is not None else None
        hybrid, plain, args = self._plan(m, wl)
        if hybrid:
            res = self._score_mixed(m, keys if type(keys) is list else list(keys), None, 0, hybrid, plain, args)
            assert res is not None
            return res
        if self._accel is not None and type(keys) is list:
            res = self._accel.score(m, keys, None, 0, self.weights, wl)
            if res is not None:
                return res
        return score_keys(m, keys, self.weights, wl)

    def query_keys(
        self, model: str, token_ids: Sequence[int] | np.ndarray, lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        return self._keys(self._model(model), token_ids, lora_name, cache_salt, None)

    def _keys(
        self, m: ModelState, token_ids: Sequence[int] | np.ndarray, lora_name: str | None,
        cache_salt: str | None, extras: list[int] | None,
    ) -> list[int]:
        return query_keys(token_ids, m.block_size, m.seed(lora_name, cache_salt), extras)

    # --- snapshots --------------------------------------------------------------------------
    def dump(self, model: str) -> list[tuple[str, int, list[KVEvent]]]:
        m = self._model(model)
        out = dump_model(m)
        dump_groups(m, out)
        return out

    def load_dump(self, model: str, block_size: int, dump: list[tuple[str, int, list[KVEvent]]]) -> int:
        """Rebuild a model from `dump` output (replaces whatever the model held)."""
        m = self._models.get(model)
        trust = m.trust if m is not None else self.trust_engine_hashes
        self._models[model] = fresh = self._new_model(model, block_size, trust)
        if self._accel is not None:
            return self._accel.load_dump(fresh, dump)
        return load_model_dump(fresh, dump) + load_groups(fresh, dump)

    def num_nodes(self, model: str) -> int:
        return len(self._model(model).nodes)
