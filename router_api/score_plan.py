"""What `IndexerService.score` keeps of the registry between queries (`ScorePlan`), and the row pieces
it answers with: the per-tier blocks of a row (`tiers_of`) and the sort keys."""
from __future__ import annotations

from operator import attrgetter

from indexer.core.types import ScoreTable
from router_api import answer
from router_api.registry import WorkerState
from schemas.api import TierBlocks


def tiers_of(d: dict[str, int] | None) -> TierBlocks:
    if not d:
        return TierBlocks()
    return TierBlocks(gpu=int(d.get("gpu", 0)), host=int(d.get("host", 0)),
                      disk=int(d.get("disk", 0)), shared=int(d.get("shared", 0)))


by_score = attrgetter("score")
dp_ranks_of = attrgetter("dp_ranks")


class ScorePlan:
    """What `score` needs of the registry, kept between queries: the model's worker states, their
    (worker_id, dp_rank) pairs, and the total rank count it was built from (its validity check); and the
    C answer writer's per-row pieces for the index order last seen (`answer_rows`)."""

    __slots__ = ("states", "nranks", "key", "pairs", "pairset", "by_id", "rows")

    def __init__(self, states: list[WorkerState], nranks: int, key: tuple[int, int]) -> None:
        self.states = states
        self.key = key
        self.nranks = nranks
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
