"""The C answer writer's cases (router_api/answer.py, `write_answer`) and the reference assembly they
are held to: IndexerService.score's rows (in-flight fields included) over drawn index rows."""
from __future__ import annotations

import struct
from array import array
from typing import Any

from hypothesis import strategies as st

from indexer.core import native as native_core
from router_api import answer
from schemas.api import WORKER_STATUSES, BestWorker, ScoreResponse, TierBlocks, WorkerScoreOut

N = native_core.select(None)  # None: not built (the tests skip)
PROW = struct.Struct("<7qd")  # score_walk.c PRow: slot, dev, cached, gpu, host, disk, shared, score
I64 = st.integers(-(2**63), 2**63 - 1)
COUNT = st.integers(0, 2**40)
ODD_FLOATS = st.sampled_from([0.0, -0.0, 1e16, 1e15, 9999999999999998.0, 1e-5, 1e-4, 9.99e-5, 1.25e-7, 5e-324,
                              1.7976931348623157e308, -2.5e-300, 38.400000000000006, 0.1, 1 / 3, 123456789.125])
SCORES = st.one_of(ODD_FLOATS, st.floats(allow_nan=False, allow_infinity=False),
                   st.integers(-(2**53), 2**53).map(float))
NAMES = st.text(min_size=1, max_size=12)


def reference(model: str, block_size: int, query_blocks: int, rows: list[dict[str, Any]],
              pos: dict[str, int], statuses: list[str], seqs: list[int | None]) -> ScoreResponse:
    """IndexerService.score's assembly of the answer, over rows in the index's order."""
    fresh: list[WorkerScoreOut] = []
    stale: list[WorkerScoreOut] = []
    for r in rows:
        i = pos.get(r["wid"], -1)
        if i < 0:
            continue
        is_stale = statuses[i] == "stale"
        pb, pr, pt, busy = r.get("pend", (0, 0, 0, None))
        (stale if is_stale else fresh).append(WorkerScoreOut(
            r["wid"], r["rank"], r["dev"], r["cach"], TierBlocks(*r["sp"]), float(r["score"]), is_stale,
            seqs[i], statuses[i], None, pb, pr, pt, busy))
    fresh.sort(key=lambda s: s.score, reverse=True)
    stale.sort(key=lambda s: s.score, reverse=True)
    best = next((BestWorker(s.worker_id, s.dp_rank) for s in fresh if s.score > 0), None)
    return ScoreResponse(model, block_size, query_blocks, fresh + stale, best)


@st.composite
def cases(draw: Any) -> dict[str, Any]:
    workers = draw(st.lists(NAMES, min_size=0, max_size=6, unique=True))
    strangers = draw(st.lists(NAMES.filter(lambda n: n not in workers), max_size=2, unique=True))
    ids = workers + strangers  # strangers: rows of the index no registered worker has
    n = draw(st.integers(0, 20)) if ids else 0
    pairs = draw(st.lists(st.tuples(st.sampled_from(ids), st.integers(0, 2**16)), min_size=n, max_size=n,
                          unique=True)) if ids else []
    rows = [{"wid": w, "rank": r, "dev": draw(COUNT), "cach": draw(COUNT),
             "sp": [draw(COUNT) for _ in range(4)], "score": draw(SCORES)} for w, r in pairs]
    extra = draw(st.lists(st.tuples(st.sampled_from(workers), st.integers(0, 2**16)), max_size=3, unique=True)
                 ) if workers else []
    extra = [p for p in extra if p not in set(pairs)]
    statuses = [draw(st.sampled_from(WORKER_STATUSES)) for _ in workers]
    seqs = [draw(st.one_of(st.none(), I64)) for _ in workers]
    return {"model": draw(st.text(max_size=10)), "bs": draw(st.integers(1, 2**20)),
            "qb": draw(st.integers(0, 2**40)), "workers": workers, "rows": rows, "extra": extra,
            "statuses": statuses, "seqs": seqs}


def columns(pend: dict[tuple[str, int], tuple[int, int, int, float | None]],
            pairs: list[tuple[str, int]]) -> tuple[array, array]:
    """The writer's in-flight columns per head (`score_plan.pending_columns`' shape)."""
    ints, busy = array("q"), array("d")
    for p in pairs:
        pb, pr, pt, b = pend.get(p, (0, 0, 0, None))
        ints.extend((pb, pr, pt))
        busy.append(float("nan") if b is None else b)
    return ints, busy


def write(c: dict[str, Any], mp: bool, fmts: answer.Formats) -> bytes | None:
    rows = c["rows"]
    wids, ranks = [r["wid"] for r in rows], [r["rank"] for r in rows]
    states = [type("S", (), {"worker_id": w})() for w in c["workers"]]
    pairs = [(r["wid"], r["rank"]) for r in rows if r["wid"] in c["workers"]] + c["extra"]
    ans = answer.AnswerRows.build(states, pairs, wids, ranks)
    packed = b"".join(PROW.pack(k, r["dev"], r["cach"], *r["sp"], r["score"]) for k, r in enumerate(rows))
    i = 1 if mp else 0  # the call IndexerService.score_answer makes
    pend = columns(c["pend"], ans.pairs) if c.get("pend") is not None else ()
    return N.write_answer(mp, fmts.layouts[i], fmts.prefix(mp, c["model"], c["bs"]), c["qb"], packed, ans.heads[i],
                          ans.wix, c["statuses"], c["seqs"], fmts.statuses[i], *pend)


