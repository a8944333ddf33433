"""What `IndexerService.score` keeps of the registry between queries (`ScorePlan`), and the rows it
answers with: the index's scores as fresh and stale rows (`score_rows`, `ScoreRows.response`), the
per-tier blocks of a row (`tiers_of`), and the rows' in-flight fields as the C answer writer takes
them (`pending_columns`)."""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from operator import attrgetter
from typing import Any, NamedTuple

from indexer.core.types import ScoreResult, ScoreTable, WorkerScore, holds
from indexer.reconcile import LivenessPolicy
from router_api import answer
from router_api.registry import RegisteredWorker
from router_api.routes import RouteBook
from schemas.api import (
    AUTO_HOLDERS_PAST, BestWorker, QueryInstance, QueryResponse, ScoreResponse, TierBlocks, WorkerScoreOut,
)

# 8-byte fields of one packed row (score_walk.c PRow: slot, device, cached, 4 tiers, score); the byte
# equality tests (tests/test_score_answer_pending.py) fail if it changes without this.
PROW_FIELDS = 8
_NO_BUSY = array("d", [float("nan")])  # busy_until None in the writer's column (a route's is never NaN)


def tiers_of(d: dict[str, int] | None) -> TierBlocks:
    if not d:
        return TierBlocks()
    return TierBlocks(gpu=int(d.get("gpu", 0)), host=int(d.get("host", 0)),
                      disk=int(d.get("disk", 0)), shared=int(d.get("shared", 0)))


by_score = attrgetter("score")


class Query(NamedTuple):
    """What one /score asks besides the model: its tokens and the namespace they hash in."""

    token_ids: Any
    lora_name: str | None
    cache_salt: str | None


class ScorePlan:
    """What `score` needs of the registry, kept between queries: the model's worker states, their
    (worker_id, dp_rank) pairs, and the key it was built at (its validity check: the registry's
    membership epoch and size and the ranks version, router_api/service.py `_plan`); and the C answer
    writer's per-row pieces for the index order last seen (`answer_rows`)."""

    __slots__ = ("states", "key", "pairs", "pairset", "by_id", "rows")

    def __init__(self, states: list[RegisteredWorker], key: tuple[int, int, int]) -> None:
        self.states = states
        self.key = key
        self.by_id = {w.worker_id: w for w in states}
        self.pairs = [(w.worker_id, rank) for w in states for rank in sorted(w.dp_ranks)]
        self.pairset = frozenset(self.pairs)
        self.rows: answer.AnswerRows | None = None

    def scope(self, held: list[tuple[str, int]]) -> list[tuple[str, int]] | None:
        """The `workers` a score call names, given the pairs the index holds: None (all of them, from
        the index's own cached order, no per-query selection) when it holds exactly the registered
        pairs, else the registered ones. The one membership check of both score paths."""
        return None if len(held) == len(self.pairs) and self.pairset.issuperset(held) else self.pairs

    def answer_rows(self, table: ScoreTable, same: bool) -> answer.AnswerRows:
        rows = self.rows
        # The index keeps its (worker_id, dp_rank) order in one list until its membership changes.
        if rows is not None and rows.worker_ids is table.worker_ids:
            return rows
        rows = answer.AnswerRows.build(self.states, self.pairs, table.worker_ids, table.ranks)
        if same:  # a per-query selection is a new list each time: not worth keeping
            self.rows = rows
        return rows


def pending_columns(book: RouteBook, index: Any, registry: Any, model: str, block_size: int,
                    query: Query, now: float, pairs: Sequence[tuple[str, int]],
                    packed: bytes) -> tuple[array, array] | tuple[()] | None:
    """The rows' in-flight fields for `write_answer` (under the service's lock), per head (`pairs`,
    `AnswerRows.pairs`): int64 (pending_blocks, pending_requests, pending_prefill_tokens) and busy_until
    (NaN: None), after the same sweep and from the same RouteBook calls as `IndexerService._add_pending`
    for the Python path's rows; () when the sweep leaves nothing in flight. `query`: (token_ids, lora_name,
    cache_salt), hashed to node keys only while some route holds blocks. pending_blocks starts past the
    row's exact match, read from the packed rows (a registered pair the index does not hold: 0).
    None: a busy_until that is not a float (msgspec would spell it as given): the caller takes msgspec."""
    book.sweep(index, registry, model, now)
    if not book.pending.active(model):
        return ()
    keys = book.keys(index, model, block_size, *query) if book.pending.has(model) else None
    n = len(pairs)
    ints = array("q", bytes(8 * 3 * n))
    busy = _NO_BUSY * n
    cached: dict[int, int] = {}
    if keys is not None:
        mv = memoryview(packed).cast("q")
        cached = dict(zip(mv[0::PROW_FIELDS].tolist(), mv[2::PROW_FIELDS].tolist()))
    load, run = book.load, book.pending_run
    for h, (wid, rank) in enumerate(pairs):
        req, tok, b = load(model, wid, rank, now)
        blocks = 0 if keys is None else run(model, wid, rank, keys, cached.get(h, 0))
        if blocks or req or tok:
            ints[3 * h], ints[3 * h + 1], ints[3 * h + 2] = blocks, req, tok
        if b is not None:
            if type(b) is not float:
                return None
            busy[h] = b
    return ints, busy


class ScoreRows:
    """One /score's rows (`score_rows`), fresh and stale apart, in the index's order."""

    __slots__ = ("model", "block_size", "query_blocks", "fresh", "stale")

    def __init__(self, model: str, block_size: int, query_blocks: int, fresh: list[WorkerScoreOut],
                 stale: list[WorkerScoreOut]) -> None:
        self.model, self.block_size, self.query_blocks = model, block_size, query_blocks
        self.fresh, self.stale = fresh, stale

    def response(self, limit: int = -1) -> ScoreResponse:
        """Best first; a stale worker may be gone, so it sorts after every fresh one (stable: the index's
        tie-break order is kept; reverse=True keeps sort stability). `limit` (`answer_limit`): -1 every
        row; 0 the holders' answer (the rows that hold something or have routes in flight); K its first K."""
        fresh, stale = self.fresh, self.stale
        fresh.sort(key=by_score, reverse=True)
        stale.sort(key=by_score, reverse=True)
        if limit >= 0:  # (a row that holds nothing scores 0: `best` is the full answer's)
            fresh = [r for r in fresh if holds(r) or in_flight(r)]
            stale = [r for r in stale if holds(r) or in_flight(r)]
        best = next((BestWorker(s.worker_id, s.dp_rank) for s in fresh if s.score > 0), None)
        rows = fresh + stale if stale else fresh
        if limit < 0:
            return ScoreResponse(self.model, self.block_size, self.query_blocks, rows, best)
        return ScoreResponse(self.model, self.block_size, self.query_blocks, rows[:limit] if limit else rows, best,
                             holders_only=True)


def in_flight(row: WorkerScoreOut) -> bool:
    """Whether an answer row has in-flight fields set (routes pending to its worker and rank)."""
    return bool(row.pending_blocks or row.pending_requests or row.pending_prefill_tokens
                or row.busy_until is not None)


def answer_limit(answer: str | None, top_k: int | None, pairs: int) -> int:
    """The answer's form as `write_answer` / `ScoreRows.response` take it: -1 a row per registered pair,
    0 the holders' answer, K > 0 its first K rows. Unset: full up to AUTO_HOLDERS_PAST pairs."""
    if top_k is not None:
        if answer == "full":
            raise ValueError("top_k cuts the holders' answer: not with answer=full")
        return top_k
    if answer is None:
        return -1 if pairs <= AUTO_HOLDERS_PAST else 0
    return 0 if answer == "holders" else -1


def score_rows(model: str, block_size: int, result: ScoreResult, plan: ScorePlan, now: float,
               policy: LivenessPolicy, holders: bool = False) -> ScoreRows:
    """The index's scores as answer rows: every registered pair is listed (a rank the index has not
    seen yet scores 0), each with its worker's status; a pair of a worker no longer registered is left out.
    `holders`: `result` holds only the rows that hold something, and only those are listed."""
    rows = result.workers
    if len(rows) != len(plan.pairs) and not holders:
        scored = {(ws.worker_id, ws.dp_rank) for ws in rows}
        rows = list(rows) + [WorkerScore(wid, rank, 0, 0, {}, 0.0) for wid, rank in plan.pairs
                             if (wid, rank) not in scored]
    by_id = plan.by_id
    fresh: list[WorkerScoreOut] = []
    stale: list[WorkerScoreOut] = []
    for ws in rows:
        w = by_id.get(ws.worker_id)
        if w is None:
            continue
        status = w.status(now, policy)
        t = ws.tiers
        tiers = TierBlocks(t["gpu"], t["host"], t["disk"], t["shared"]) if len(t) == 4 else tiers_of(t)
        is_stale = status == "stale"
        (stale if is_stale else fresh).append(WorkerScoreOut(
            ws.worker_id, ws.dp_rank, ws.device_blocks, ws.cached_blocks, tiers, float(ws.score),
            is_stale, w.last_seq, status, ws.kv_blocks))
    return ScoreRows(model, block_size, result.query_blocks, fresh, stale)


def query_response(res: ScoreResponse) -> QueryResponse:
    """`/query`'s Dynamo / Mooncake-RFC shape of a /score answer, in tokens; per worker the best dp rank's tiers."""
    bs = res.block_size
    inst: dict[str, QueryInstance] = {}
    for s in res.workers:
        tokens = s.cached_blocks * bs
        cur = inst.get(s.worker_id)
        if cur is None:
            cur = inst[s.worker_id] = QueryInstance(0, 0, 0, 0, {})
        cur.dp[str(s.dp_rank)] = tokens
        if tokens > cur.longest_matched or (tokens == cur.longest_matched and not cur.dp):
            cur.longest_matched = tokens
            cur.gpu = s.tiers.gpu * bs
            cur.cpu = s.tiers.host * bs
            cur.disk = (s.tiers.disk + s.tiers.shared) * bs
    return QueryResponse(instances=inst)
