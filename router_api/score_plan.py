"""What `IndexerService.score` keeps of the registry between queries (`ScorePlan`), and the row pieces
it answers with: the per-tier blocks of a row (`tiers_of`), the sort keys, and the rows' in-flight
fields as the C answer writer takes them (`pending_columns`)."""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from indexer.core.types import ScoreTable
from router_api import answer
from router_api.registry import WorkerState
from router_api.routes import RouteBook
from schemas.api import TierBlocks

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


class ScorePlan:
    """What `score` needs of the registry, kept between queries: the model's worker states, their
    (worker_id, dp_rank) pairs, and the key it was built at (its validity check: the registry's
    membership epoch and size and the ranks version, router_api/service.py `_plan`); and the C answer
    writer's per-row pieces for the index order last seen (`answer_rows`)."""

    __slots__ = ("states", "key", "pairs", "pairset", "by_id", "rows")

    def __init__(self, states: list[WorkerState], key: tuple[int, int, int]) -> None:
        self.states = states
        self.key = key
        self.by_id = {w.worker_id: w for w in states}
        self.pairs = [(w.worker_id, rank) for w in states for rank in sorted(w.dp_ranks)]
        self.pairset = frozenset(self.pairs)
        self.rows: answer.AnswerRows | None = None

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
                    query: tuple[Any, str | None, str | None], now: float, pairs: Sequence[tuple[str, int]],
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
