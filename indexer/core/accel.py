"""The C accelerator as seen by `KVIndex`: two whole-call hot paths over the core's own state.

- `apply_payload`: one raw msgpack batch of one worker, walked and applied in C (`apply_msgpack`)
  when it is the common case; it stops before an orphan and the pure core (`apply_events`) applies
  the rest. None means "nothing was touched: take the pure path" (odd payloads, workers with pending
  orphans, LoRA / salt / extra-key stores), which judges the payload exactly.
- `score`: the walk, weights, ranking and result rows in one call (`score_rows`); `score_table`, the
  same with the rows packed for the service's C answer writer (`write_answer`, router_api/answer.py).
Plus `new_map`: the compact U64Map the core's maps are made of. Nothing else of the core is in C;
the rules live once in `indexer.core.apply` / `indexer.core.scoring` and the C walk follows them
(wire tables generated from `schemas/`; the conformance suite holds the two to each other;
docs/index-core.md says what stays in C and why).
"""
from __future__ import annotations

from array import array
from collections.abc import Callable
from types import ModuleType
from typing import Any

from indexer.core.apply import KNOWN_EXT_LIMIT, apply_events, decode_or_drop, finite_ts
from indexer.core.dump import dump_stores, put_entries
from indexer.core.groupdump import load_groups
from indexer.core.groups import learn_store
from indexer.core.state import ModelState, WorkerState
from indexer.core.types import (
    TIER_NAMES, ApplyStats, RankLimits, ScoreResult, ScoreTable, TierWeights, WorkerScore,
)
from schemas.rules import SLOTS_PER_WORD


def _pure_only(w: WorkerState) -> bool:
    """A worker whose layout's main tree is not group 0 (its group-0 events are another group's, or
    would set its main group): its batches are the pure core's. The C walk applies the main-tree
    events of the others and stops at the first group event (a worker with a layout: also at a
    clear), which the pure core applies from there (docs/hybrid.md)."""
    lay = w.layout
    return lay is not None and lay.primary != 0


def _groups_arg(m: ModelState, w: WorkerState) -> tuple | None:
    """The worker's layout for the C walk (groups_apply.c): per group (group_idx, kind, has_window,
    window, nodes, the worker's map); a window outside [0, 2^63) makes its group never match there.
    Built once per group table version and slot (`Layout.accel`): a hybrid worker's every batch passes it."""
    lay = w.layout
    if lay is None:
        return None
    version = m.groups.version
    if lay.accel_at == version and lay.accel_slot == w.slot:
        return lay.accel
    out = []
    for gi, g in lay.groups.items():
        win = g.window
        ok = win is None or (type(win) is int and 0 <= win < 2**63)
        out.append((gi, g.kind if ok else -1, int(win is not None), win if ok and win is not None else 0, g.nodes,
                    g.slot_map(w.slot)))
    arg = lay.accel = tuple(out)
    lay.accel_at, lay.accel_slot = version, w.slot
    return arg


def _learner(m: ModelState, w: WorkerState, fresh: bool) -> Callable[[int, int, int | None], tuple | None] | None:
    """The C walk's callback for a store of a group outside `w`'s layout (groups_apply.c, gp_learn):
    `groups.learn_store`, then the new layout tuple, or None (the pure core judges the event). Given
    once the model has groups, and on a worker's first batch (a model's first layout); else None: a
    batch of a model without groups pays nothing for it, and its first group event is the pure core's.
    A worker with a layout keeps its closure on the layout (made once)."""
    if m.groups is None and not fresh:
        return None
    lay = w.layout
    if lay is not None and lay.learn is not None:
        return lay.learn

    def learn(gi: int, kind: int, window: int | None) -> tuple | None:
        return _groups_arg(m, w) if learn_store(m, w, gi, kind, window) else None

    if lay is not None:
        lay.learn = learn
    return learn


def hybrid_args(ws: list[WorkerState]) -> tuple[list, list, list, list, list]:
    """`hybrid_rows`' groups, layouts and slots for these workers (each group once, each layout as
    the positions of its groups; a plain worker's is empty), and their worker ids and ranks
    (`hybrid_score`'s rows)."""
    groups: list[tuple[int, int, Any]] = []
    at: dict[int, int] = {}
    layouts = []
    for w in ws:
        idx = []
        for g in (w.layout.groups.values() if w.layout is not None else ()):
            i = at.get(id(g))
            if i is None:
                i = at[id(g)] = len(groups)
                groups.append((g.kind, -1 if g.span is None else g.span, g.nodes))
            idx.append(i)
        layouts.append(tuple(idx))
    return groups, layouts, [w.slot for w in ws], [w.worker_id for w in ws], [w.dp_rank for w in ws]


def _c_worker(m: ModelState, worker_id: str, rank: int) -> tuple[WorkerState, bool] | None:
    """The worker a C apply writes to and whether it was made for this payload; None when only the pure
    core may judge it (orphans wait on it, or its layout is one the C walk does not take)."""
    w = m.by_id.get((worker_id, rank))
    if w is not None and (w.pending or _pure_only(w)):
        return None
    if w is None:
        return m.worker(worker_id, rank), True
    return w, False


class Accelerator:
    __slots__ = ("mod", "new_map", "new_nodes", "new_churn_map", "_positions")

    def __init__(self, mod: ModuleType) -> None:
        self.mod = mod
        # per model: its ranked tuple (identity: valid until a worker comes or goes) and each slot's
        # position in it (int32, -1: none), the holders' walk's map from a node's holders to rows
        self._positions: dict[int, tuple[object, bytes]] = {}
        self.new_map: Callable[[], Any] = mod.U64Map
        self.new_nodes: Callable[[], Any] = mod.U64Map.holders  # a main tree: holder lists past 128 slots
        self.new_churn_map: Callable[[], Any] = mod.U64Map.sparse  # sliding-window and Mamba group maps

    # --- apply ------------------------------------------------------------------------------
    def apply_payload(
        self, m: ModelState, worker_id: str, rank: int, payload: bytes, grace: int, rank_from_batch: bool,
        limits: RankLimits,
    ) -> ApplyStats | None:
        """`KVIndex.apply_payload` for what the C walk takes, or None (nothing touched, no worker
        registered). With `rank_from_batch` the walk reads the batch's rank before touching anything:
        the maps passed are those of `rank` (the default), and a batch naming another rank is retried
        once with that rank's maps, if `limits` admit that rank."""
        apply_msgpack = self.mod.apply_msgpack
        known = m.known_ext if m.trust else None
        if not rank_from_batch:  # the common case: one C call, nothing to compare afterwards
            found = _c_worker(m, worker_id, rank)
            if found is None:
                return None
            w, fresh = found
            lay = w.layout
            # positional: keyword parsing costs more than the walk of a small batch (docs/index-core.md)
            if lay is not None and lay.learn is not None and lay.accel_at == m.groups.version and lay.accel_slot == w.slot:
                # a hybrid worker's steady state: its groups tuple and callback as last built
                res = apply_msgpack(payload, w.ext, m.nodes, known, w.shift, m.block_size, m.seed0, KNOWN_EXT_LIMIT,
                                    None, 0, lay.accel, lay.learn)
            elif m.groups is None and not fresh:
                res = apply_msgpack(payload, w.ext, m.nodes, known, w.shift, m.block_size, m.seed0, KNOWN_EXT_LIMIT)
            else:
                res = apply_msgpack(payload, w.ext, m.nodes, known, w.shift, m.block_size, m.seed0, KNOWN_EXT_LIMIT,
                                    None, 0, _groups_arg(m, w), _learner(m, w, fresh))
            if res is None:
                if fresh:
                    m.remove(w)  # a payload the C walk does not take must not register its worker
                return None
            stats = ApplyStats(res[1], res[2])
            if res[0] >= 0:
                self._apply_rest(m, w, payload, res[0], grace, stats)
            return stats
        default = rank
        for _ in range(2):
            found = _c_worker(m, worker_id, rank)
            if found is None:
                return None
            w, fresh = found
            res = apply_msgpack(
                payload, w.ext, m.nodes, known, w.shift, m.block_size, m.seed0, KNOWN_EXT_LIMIT, rank, default,
                _groups_arg(m, w), _learner(m, w, fresh),
            )
            if res is None:
                if fresh:
                    m.remove(w)  # a payload the C walk does not take must not register its worker
                return None
            stop, counts, drops, ts, got, n = res
            ts = finite_ts(ts)
            if got != rank or not n:
                if fresh:
                    m.remove(w)  # nothing applied: a worker only the rank guess created goes again
                refused = m.refuses(worker_id, got, default, limits)
                if refused is not None:  # nothing applied, no worker made; a heartbeat reports no rank
                    return ApplyStats(drops={refused: n} if n else {}, ts=ts, n_events=n)
                if not n:
                    return ApplyStats(dp_rank=got, ts=ts)  # a heartbeat
                rank = got
                continue
            stats = ApplyStats(counts, drops, dp_rank=got, ts=ts, n_events=n)
            if stop >= 0:
                self._apply_rest(m, w, payload, stop, grace, stats)
            return stats
        return None

    def apply_run(
        self, m: ModelState, worker_id: str, rank: int, default: int, payloads: list[bytes], grace: int,
        max_payload: int,
    ) -> tuple[int, ApplyStats, ApplyStats | None]:
        """`KVIndex.apply_run` on the C walk: whole batches of `rank` applied in one call while they
        are the common case; (0, empty stats, None) when the worker is unknown or has orphans."""
        w = m.by_id.get((worker_id, rank))
        if w is None or w.pending or _pure_only(w):
            return 0, ApplyStats(), None
        k, counts, drops, ts, n_events, partial = self.mod.apply_msgpack_run(
            payloads, w.ext, m.nodes, m.known_ext if m.trust else None, w.shift, m.block_size, m.seed0,
            KNOWN_EXT_LIMIT, rank, default, max_payload, _groups_arg(m, w), _learner(m, w, False),
        )
        extra = None
        if partial is not None:  # payloads[k] stopped at an orphan: the pure core finishes it
            stop, pc, pd, pts, got, n = partial
            extra = ApplyStats(pc, pd, dp_rank=got, ts=finite_ts(pts), n_events=n)
            self._apply_rest(m, w, payloads[k], stop, grace, extra)
        return k, ApplyStats(counts, drops, dp_rank=rank, ts=ts, n_events=n_events), extra

    def tier_counts(self, m: ModelState, w: WorkerState) -> list[int]:
        """`ModelState.tier_counts` in one C pass (the pure core when the maps hold odd values)."""
        res = self.mod.tier_counts(w.ext, m.nodes, w.shift)
        return list(res) if res is not None else m.tier_counts(w)

    # --- restore ----------------------------------------------------------------------------
    @staticmethod
    def put(nodes: Any, ext: Any, hashes: list[Any], keys: list[Any], pos: int) -> int:
        """`dump.put_entries` in one C call (`U64Map.load`); the Python loop for what it does not take."""
        n = nodes.load([(ext, hashes, keys, pos)])
        return put_entries(nodes, ext, hashes, keys, pos) if n is None else n

    def load_dump(self, m: ModelState, dump: list[tuple[str, int, list[Any]]]) -> int:
        """`load_model_dump` + `load_groups` with the main tree's stores in one C call, which lays the
        residency table out once at its final width (the per-entry loop re-laid it once per new word
        of slots: ~600 times at 10k workers, docs/scaling.md); groups one C call per store."""
        stores = dump_stores(m, dump)
        n = m.nodes.load([(s.worker.ext, s.hashes, s.keys, s.worker.shift + s.tier) for s in stores])
        if n is None:  # a store the C loop does not take (odd hashes): the reference, store by store
            n = sum(self.put(m.nodes, s.worker.ext, s.hashes, s.keys, s.worker.shift + s.tier) for s in stores)
        return n + load_groups(m, dump, self.put)

    @staticmethod
    def narrow(m: ModelState) -> None:
        """Give back the residency words no slot uses any more (after `ModelState` compacted them): no
        value is wider than the slots still allocated, so while that bound keeps the table's width (or
        its holder lists) nothing is scanned."""
        m.nodes.narrow(-(-len(m.workers) // SLOTS_PER_WORD))

    @staticmethod
    def _apply_rest(m: ModelState, w: WorkerState, payload: bytes, start: int, grace: int, stats: ApplyStats) -> None:
        """Events `start`.. of a payload whose earlier events the C walk applied into `stats`."""
        batch = decode_or_drop(payload, stats)  # the C walk accepted it, so this decodes; judged regardless
        if batch is not None:
            apply_events(m, w, batch.events, grace, stats, start)

    # --- score ------------------------------------------------------------------------------
    @staticmethod
    def _selection(m: ModelState, workers: list[tuple[str, int]] | None) -> tuple[list[int], list[str], list[int]]:
        """Slots, worker ids and ranks of the workers a score covers (all, in the core's order, or
        the named ones that exist, sorted)."""
        if workers is None:
            _, slots, wids, ranks = m.ranked()
            return slots, wids, ranks
        ws = sorted(
            (w for w in (m.by_id.get((wid, int(r))) for wid, r in workers) if w is not None),
            key=lambda w: (w.worker_id, w.dp_rank),
        )
        return [w.slot for w in ws], [w.worker_id for w in ws], [w.dp_rank for w in ws]

    def score(
        self, m: ModelState, keys: list[int] | None, tokens: object, seed: int, weights: TierWeights,
        workers: list[tuple[str, int]] | None,
    ) -> ScoreResult | None:
        """The whole score (keys hashed from `tokens` when `keys` is None), or None when the C call
        cannot judge the input (the pure core does)."""
        slots, wids, ranks = self._selection(m, workers)
        # positional, like apply_msgpack: keyword parsing is a large share of a short query's cost
        res = self.mod.score_rows(
            m.nodes, keys, tokens, seed, m.block_size, slots, wids, ranks, weights.as_tuple(), WorkerScore, TIER_NAMES,
        )
        if res is None:
            return None
        return ScoreResult(query_blocks=res[0], block_size=m.block_size, workers=res[1])

    def hybrid_score(
        self, m: ModelState, keys: list[int] | None, tokens: object, seed: int, weights: TierWeights,
        ws: list[WorkerState], args: tuple | None = None,
    ) -> ScoreResult | None:
        """`groupscore.score_groups` (and `score_keys` for plain workers) in one C call (`hybrid_rows`,
        keys hashed from `tokens` when `keys` is None): the rows weighted, ranked and built in C (`ws` in
        (worker_id, dp_rank) order, as `score`'s; plain workers with an empty layout); None when the C
        call cannot judge the input (the pure core does). `args`: `hybrid_args(ws)`, when the caller
        keeps them."""
        res = self._hybrid_rows(m, keys, tokens, seed, weights, args if args is not None else hybrid_args(ws),
                                WorkerScore)
        if res is None:
            return None
        return ScoreResult(query_blocks=res[0], block_size=m.block_size, workers=res[1])

    def hybrid_table(
        self, m: ModelState, tokens: object, seed: int, weights: TierWeights, ws: list[WorkerState],
        args: tuple | None = None,
    ) -> ScoreTable | None:
        """`hybrid_score` without a row object: the ranked rows packed for `write_answer` and their
        kv_blocks column (`ScoreTable.kv`); None as there."""
        args = args if args is not None else hybrid_args(ws)
        res = self._hybrid_rows(m, None, tokens, seed, weights, args, None)
        if res is None:
            return None
        return ScoreTable(res[0], m.block_size, args[3], args[4], res[1], res[2])

    def _hybrid_rows(self, m: ModelState, keys: list[int] | None, tokens: object, seed: int,
                     weights: TierWeights, args: tuple, row_type: Any) -> Any:
        """The C `hybrid_rows` over `args` (`hybrid_args`): rows of `row_type`, or packed rows and the
        kv column when it is None; None when it cannot judge the input."""
        groups, layouts, slots, wids, ranks = args
        return self.mod.hybrid_rows(
            m.nodes, keys, tokens, seed, m.block_size, groups, layouts, slots, weights.as_tuple(), row_type,
            TIER_NAMES, wids, ranks,
        )

    def table_lane(self, m: Any, seed: int, weights: TierWeights) -> Callable[[object], ScoreTable | None]:
        """`score_table(m, tokens, seed, weights, None)` with all but the tokens bound, for a caller that
        scores an unchanged model many times and knows when it changed (indexer/sharded.py's views): per
        query, one call into C and the ScoreTable, not the selection and argument building again."""
        _, slots, wids, ranks = m.ranked()
        score_rows, nodes, bs, wt = self.mod.score_rows, m.nodes, m.block_size, weights.as_tuple()

        def table(tokens: object) -> ScoreTable | None:
            res = score_rows(nodes, None, tokens, seed, bs, slots, wids, ranks, wt, None, TIER_NAMES)
            return None if res is None else ScoreTable(res[0], bs, wids, ranks, res[1])
        return table

    def holder_rows(self, m: ModelState, tokens: object, seed: int, weights: TierWeights,
                    row_type: Any) -> tuple[int, Any, list[str], list[int]] | None:
        """Every worker's score (the core's order) kept to the rows that hold something (`holder_rows`:
        packed rows with row type None, else `row_type` objects), with the order's ids and ranks; None
        where the C call does not take it (the caller filters the full score)."""
        ranked = m.ranked()
        _, slots, wids, ranks = ranked
        hit = self._positions.get(id(m))
        if hit is None or hit[0] is not ranked:
            pos = array("i", [-1]) * (max(slots) + 1 if slots else 0)
            for i, sl in enumerate(slots):
                pos[sl] = i
            if len(self._positions) > 256:  # models come and go: start afresh rather than grow
                self._positions.clear()
            hit = self._positions[id(m)] = (ranked, pos.tobytes())
        res = self.mod.holder_rows(m.nodes, tokens, seed, m.block_size, hit[1], len(slots), weights.as_tuple(),
                                   row_type, TIER_NAMES, wids, ranks)
        return None if res is None else (res[0], res[1], wids, ranks)

    def score_table(
        self, m: ModelState, tokens: object, seed: int, weights: TierWeights, workers: list[tuple[str, int]] | None,
    ) -> ScoreTable | None:
        """`score` without a row object: the ranked rows packed for `write_answer` (the service writes
        the answer bytes from them in C), or None when the C call cannot judge the input."""
        slots, wids, ranks = self._selection(m, workers)
        res = self.mod.score_rows(
            m.nodes, None, tokens, seed, m.block_size, slots, wids, ranks, weights.as_tuple(), None, TIER_NAMES,
        )
        if res is None:
            return None
        return ScoreTable(res[0], m.block_size, wids, ranks, res[1])
