"""The /score answer's in-flight fields (`pending_blocks`, `pending_requests`, `pending_prefill_tokens`,
`busy_until`; docs/reference.md, "In-flight routes") written in C (`write_answer`, router_api/answer.py,
from `score_plan.pending_columns`): byte for byte what msgspec encodes for the Python path's rows, JSON
and msgpack, each field present or omitted (omit_defaults), busy_until over any finite double. Then
whole services taking route reports (with and without busy_until), releases, worker events, clock
steps past the TTL and workers leaving: every answer is written in C (kvatlas_score_answers_total
counts no msgspec answer) and equals msgspec's encoding of `score`, decoding to the same ScoreResponse,
on the native core and on a sharded index."""
from __future__ import annotations

import random
import struct
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.core import native as native_core
from indexer.pending import PendingRoutes
from indexer.index import KVIndex
from indexer.sharded import ShardedIndex
from router_api import answer
from router_api.config import ServiceConfig
from router_api.service import IndexerService
from schemas.api import RegisterWorker, ScoreResponse
from schemas.events import KVEventBatch
from support.answer_cases import N, ODD_FLOATS, cases, columns, reference, write
from support.service import WorkerSim, make_prompts

pytestmark = pytest.mark.skipif(not native_core.available(), reason="native module not built")

ENCODINGS = ((False, msgspec.json.encode), (True, msgspec.msgpack.encode))
FIELD = st.one_of(st.just(0), st.integers(1, 2**20), st.integers(-(2**63), 2**63 - 1))
BUSY = st.one_of(st.none(), ODD_FLOATS, st.floats(allow_nan=False, allow_infinity=False),
                 st.floats(1.7e9, 1.8e9))  # epoch seconds, the usual shared clock
PEND = st.tuples(FIELD, FIELD, FIELD, BUSY)


@st.composite
def pending_cases(draw: Any) -> dict[str, Any]:
    """A writer case (support.answer_cases.cases) whose heads each may carry in-flight fields."""
    c = draw(cases())
    pairs = [(r["wid"], r["rank"]) for r in c["rows"]] + c["extra"]
    c["pend"] = {p: draw(PEND) for p in pairs if draw(st.booleans())}
    return c


def expected(c: dict[str, Any]) -> ScoreResponse:
    zero = {"dev": 0, "cach": 0, "sp": [0, 0, 0, 0], "score": 0.0}
    rows = c["rows"] + [{"wid": w, "rank": r, **zero} for w, r in c["extra"]]
    rows = [dict(r, pend=c["pend"].get((r["wid"], r["rank"]), (0, 0, 0, None))) for r in rows]
    return reference(c["model"], c["bs"], c["qb"], rows, {w: i for i, w in enumerate(c["workers"])},
                     c["statuses"], c["seqs"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pending_cases())
def test_in_flight_fields_are_written_like_msgspec(c: dict[str, Any]) -> None:
    fmts = answer.Formats()
    ref = expected(c)
    for mp, enc in ENCODINGS:
        assert write(c, mp, fmts) == enc(ref)
    if c["pend"]:  # the same heads with no in-flight field set: the plain rows, with or without columns
        plain = {**c, "pend": {p: (0, 0, 0, None) for p in c["pend"]}}
        for mp, enc in ENCODINGS:
            assert write(plain, mp, fmts) == write({**c, "pend": None}, mp, fmts) == enc(expected(plain))


@settings(max_examples=2000, deadline=None)
@given(st.integers(0, 2**64 - 1).map(lambda b: struct.unpack("<d", struct.pack("<Q", b))[0]))
def test_any_finite_busy_until_is_spelled_like_msgspec(busy: float) -> None:
    """busy_until goes to C as a double: msgspec's JSON spelling (the score's, answer.c json_double) and
    msgpack float64 for any bit pattern; an infinite one defers to msgspec (None). NaN is the column's
    None (a route's busy_until is never NaN: indexer/pending.py drops it)."""
    b = None if busy != busy else busy
    c = {"model": "m", "bs": 1, "qb": 1, "workers": ["w"], "rows": [
        {"wid": "w", "rank": 0, "dev": 1, "cach": 1, "sp": [1, 0, 0, 0], "score": 1.0}], "extra": [],
        "statuses": ["live"], "seqs": [7], "pend": {("w", 0): (2, 1, 9, b)}}
    fmts = answer.Formats()
    for mp, enc in ENCODINGS:
        got = write(c, mp, fmts)
        if b is not None and not np.isfinite(b):
            assert got is None
        else:
            assert got == enc(expected(c))


def test_writer_defers_malformed_columns() -> None:
    fmts = answer.Formats()
    c = {"model": "m", "bs": 1, "qb": 1, "workers": ["w"], "rows": [
        {"wid": "w", "rank": 0, "dev": 1, "cach": 1, "sp": [1, 0, 0, 0], "score": 1.0}], "extra": [],
        "statuses": ["live"], "seqs": [7], "pend": {("w", 0): (3, 1, 12, 5.5)}}
    assert write(c, False, fmts) is not None
    lay, pre = fmts.layouts[0], fmts.prefix(False, "m", 1)
    packed = struct.pack("<7qd", 0, 1, 1, 1, 0, 0, 0, 1.0)
    head, wix = (b'"worker_id":"w","dp_rank":0',), struct.pack("<i", 0)
    ints, busy = columns(c["pend"], [("w", 0)])
    args = (False, lay, pre, 1, packed, head, wix, ["live"], [7], fmts.statuses[0])
    assert N.write_answer(*args, ints, busy) == write(c, False, fmts)
    assert N.write_answer(*args, ints) is None                      # one column without the other
    assert N.write_answer(*args, ints[:-1], busy) is None           # short columns
    assert N.write_answer(*args, ints, busy + busy) is None
    assert N.write_answer(*args, ints, struct.pack("<d", float("inf"))) is None  # msgspec writes null
    mp_lay = fmts.layouts[1]
    assert N.write_answer(True, (b"\x8d",) + mp_lay[1:], *args[2:], ints, busy) is None  # no room for 4 more


# --- whole services -------------------------------------------------------------------------------

BS = 4
MODEL = "default"


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _service(kind: str, clock: _Clock) -> IndexerService:
    index = ShardedIndex(2, native=True) if kind == "sharded" else KVIndex(native=True)
    svc = IndexerService(ServiceConfig(block_size=BS, stale_after_s=1e6, remove_after_s=2e6), index=index,
                         clock=clock, pending=PendingRoutes(ttl_s=5.0, max_routes=6))
    svc.index.ensure_model(MODEL, BS)
    return svc


def _register(svc: IndexerService, wid: str) -> None:
    svc.register(RegisterWorker(worker_id=wid, endpoint=f"tcp://127.0.0.1:{1000 + int(wid[1:])}", block_size=BS))


op = st.one_of(
    st.tuples(st.just("events"), st.integers(0, 3), st.integers(1, 3)),
    st.tuples(st.just("report"), st.integers(0, 3), st.integers(0, 8), st.one_of(st.none(), st.floats(0, 2e3))),
    st.tuples(st.just("release"), st.integers(0, 8)),
    st.tuples(st.just("clock"), st.floats(0.0, 4.0)),
    st.tuples(st.just("rejoin"), st.integers(0, 3)),
)


@pytest.mark.parametrize("kind", ["native", "sharded"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=25), seed=st.integers(0, 1 << 16))
def test_service_writes_in_flight_rows_in_c(kind: str, ops: list[tuple], seed: int) -> None:
    clock = _Clock()
    svc = _service(kind, clock)
    wids = ["w0", "w1", "w2", "w3"]
    for w in wids:
        _register(svc, w)
    svc.registry.add_rank(svc.registry.get("w3"), 1)  # a registered rank the index has not seen: a zero row
    prompts = make_prompts(seed, BS, n=4, blocks=3)
    sims = {w: WorkerSim(seed + i, BS, prompts) for i, w in enumerate(wids)}
    rng = random.Random(seed)
    counts = svc.metrics.score_answers
    written = 0
    for o in [("report", 1, 0, 1500.5)] + ops:  # at least one route in flight
        if o[0] == "events":
            w = wids[o[1]]
            events = [e for _ in range(o[2]) for e in sims[w].step()]
            with svc.lock:
                svc.index.apply(MODEL, w, 0, KVEventBatch(1.0, events, 0))
        elif o[0] == "report":
            q = rng.choice(prompts + [p[:5] for p in prompts])
            svc.report_route(MODEL, f"r{o[2]}", wids[o[1]], q, dp_rank=0, busy_until=o[3])
        elif o[0] == "release":
            svc.release_route(MODEL, f"r{o[1]}")
        elif o[0] == "clock":
            clock.t += o[1]
        else:  # the worker leaves and comes back empty: its routes are forgotten
            w = wids[o[1]]
            svc.unregister(w)
            _register(svc, w)
            sims[w].clear()
        for q in [list(p) + [7] * BS for p in prompts] + [prompts[0][:BS], [5, 6]]:
            for mp, enc in ENCODINGS:
                for body in (q, np.asarray(q, dtype="<u4")):
                    got = svc.score_answer(MODEL, body, None, None, mp)
                    written += 1
                    ref = svc.score(MODEL, q)
                    assert got == enc(ref)
                    dec = (msgspec.msgpack if mp else msgspec.json).decode(got, type=ScoreResponse)
                    assert dec == ref
    assert counts.get("c") == written and counts.get("msgspec") == 0


def test_a_busy_until_msgspec_would_spell_as_given_takes_msgspec() -> None:
    """An embedded router may report busy_until as an int: the Python rows keep it and msgspec writes
    `5`, not `5.0`; the C path defers (counted as a msgspec answer) and the bytes stay msgspec's."""
    clock = _Clock()
    svc = _service("native", clock)
    for w in ("w0", "w1"):
        _register(svc, w)
    q = list(range(1, 3 * BS + 1))
    svc.report_route(MODEL, "r0", "w0", q, busy_until=5)  # type: ignore[arg-type]
    for mp, enc in ENCODINGS:
        assert svc.score_answer(MODEL, q, None, None, mp) == enc(svc.score(MODEL, q))
    assert b'"busy_until":5}' in svc.score_answer(MODEL, q)
    assert svc.metrics.score_answers.get("msgspec") == 3 and svc.metrics.score_answers.get("c") == 0
    svc.report_route(MODEL, "r1", "w1", q, busy_until=7.25)
    svc.release_route(MODEL, "r0")
    clock.t += 6.0  # past the TTL: w0's busy_until is gone, w1's too
    svc.report_route(MODEL, "r2", "w1", q, busy_until=1.5)
    assert svc.score_answer(MODEL, q) == msgspec.json.encode(svc.score(MODEL, q))
    assert svc.metrics.score_answers.get("c") == 1

def test_a_failing_in_flight_lookup_costs_neither_path_its_exact_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The query's node keys failing: both paths count the drop and answer the exact rows alone, the
    same bytes; the C path still writes it."""
    from router_api.routes import RouteBook

    clock = _Clock()
    svc = _service("native", clock)
    for w in ("w0", "w1"):
        _register(svc, w)
    q = list(range(1, 3 * BS + 1))
    svc.report_route(MODEL, "r0", "w0", q, busy_until=3.5)

    def broken(*args: Any) -> list[int]:
        raise RuntimeError("keys unavailable")

    monkeypatch.setattr(RouteBook, "keys", staticmethod(broken))
    for mp, enc in ENCODINGS:
        got = svc.score_answer(MODEL, q, None, None, mp)
        assert got == enc(svc.score(MODEL, q))
        assert b"pending" not in got and b"busy_until" not in got
    assert svc.metrics.drops.get("pending_error") == 4
    assert svc.metrics.score_answers.get("c") == 2 and svc.metrics.score_answers.get("msgspec") == 0
