"""`GET /router/state` stays bounded whatever the fleet: at most TOP_WORKERS worker rows (most
routed and in flight first), the last LAST_DECISIONS sampled decisions, every string clipped, and
counts from router/proxy/tally.py's hooks classified as the page documents (scored / fallback /
unscored; errors; accuracy only for scored routes the engine reported on)."""
from __future__ import annotations

import math

import msgspec
import numpy as np
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from router.proxy.app import create_proxy_app
from router.proxy.core import ProxyCore, Route
from router.proxy.page import LAST_DECISIONS, MAX_TEXT, TOP_WORKERS, percentile_ms, router_state
from router.proxy.stats import Histogram
from router.proxy.tally import Tally, outcome_of


def _core(n: int, id_len: int = 8) -> ProxyCore:
    workers = {f"w{i:0{id_len}d}": f"http://127.0.0.1:{10000 + i}" for i in range(n)}
    core = ProxyCore(workers, indexer=None, model="m", tokenizer=None, policy="round_robin")
    for st_ in core.poller.states.values():
        st_.up, st_.reason = True, "ok"
    return core


def _route(worker: str, *, scored: bool = True, reason: str = "", predicted: int | None = 8, i: int = 0) -> Route:
    r = Route(f"r{i}", np.zeros(16, dtype="<u4"), "round_robin", "m")
    r.worker_id, r.scored, r.unscored_reason, r.cached_tokens, r.decide_s = worker, scored, reason, predicted, 0.0004
    return r


def test_state_is_bounded_and_ordered() -> None:
    core = _core(300, id_len=5000)  # ids far past MAX_TEXT
    ids = list(core.workers)
    for i in range(LAST_DECISIONS * 3):
        r = _route(ids[i % 100], i=i)
        core.tally.sample(r)
        core.tally.routed(r)
        core.tally.answered(r, 8)
    core.inflight[ids[250]] = 500  # in flight counts towards the order
    s = router_state(core)
    assert len(s["workers"]) == TOP_WORKERS and s["workers_total"] == 300
    assert s["workers"][0]["worker_id"] == ids[250][:MAX_TEXT - 1] + "…"
    assert all(len(w["worker_id"]) <= MAX_TEXT for w in s["workers"])
    routed = [w["routed"] for w in s["workers"][1:]]
    assert routed == sorted(routed, reverse=True) and routed[0] == 2
    assert len(s["decision_log"]["samples"]) == LAST_DECISIONS
    assert s["decision_log"]["samples"][0]["request_id"] == f"r{LAST_DECISIONS * 3 - 1}"  # newest first
    assert len(core.tally._pending) == 0  # answered samples leave the pending map
    assert len(msgspec.json.encode(s)) < 200_000


def test_endpoint_clamps_and_page_is_served() -> None:
    core = _core(100)
    c = TestClient(create_proxy_app(core))
    page = c.get("/")
    assert page.status_code == 200 and "router/state" in page.text and "innerHTML" not in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert len(c.get("/router/state", params={"top": 10**6, "last": 10**6}).json()["workers"]) == TOP_WORKERS
    assert len(c.get("/router/state", params={"top": 3}).json()["workers"]) == 3
    assert c.get("/router/state", params={"top": "x"}).status_code == 422


def test_outcomes_errors_and_accuracy_per_worker() -> None:
    t = Tally()
    seen = [(_route("a", i=1), 8), (_route("a", predicted=4, i=2), 10), (_route("a", scored=False, reason="no_tokens",
            predicted=None, i=3), 3), (_route("b", scored=False, reason="indexer_unreachable", predicted=None, i=4), 0),
            (_route("b", scored=False, reason="retried", predicted=None, i=5), None)]
    for r, served in seen:
        t.routed(r)
        t.answered(r, served)
    broke = _route("b", i=6)
    t.routed(broke)
    t.broke(broke)
    a, b = t.cells[("m", "a")], t.cells[("m", "b")]
    assert (a.routed, a.scored, a.unscored, a.fallback, a.answered) == (3, 2, 1, 0, 3)
    assert (a.compared, a.exact, a.under, a.abs_error_tokens) == (2, 1, 1, 6)  # the unscored one is not compared
    assert (b.routed, b.scored, b.fallback, b.errors, b.answered, b.compared) == (3, 1, 2, 1, 2, 0)
    assert t.latency["m"].n == 6


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.0, 2.0), min_size=1, max_size=200), st.floats(0.01, 1.0))
def test_percentile_is_the_bucket_bound_holding_the_quantile(xs: list[float], q: float) -> None:
    h = Histogram()
    for x in xs:
        h.observe(x)
    got = percentile_ms(h, q)
    k = sorted(xs)[max(1, math.ceil(q * len(xs))) - 1]  # the ceil(q n)-th smallest
    if got is None:
        assert k > 1.0
    else:
        assert k <= got / 1e3 + 1e-12 and sum(x <= got / 1e3 + 1e-12 for x in xs) >= q * len(xs)


def test_outcome_names() -> None:
    assert outcome_of(True, "") == "scored"
    assert outcome_of(False, "indexer_refusing") == outcome_of(False, "retried") == "fallback"
    assert outcome_of(False, "no_tokens") == outcome_of(False, "no_indexer") == "unscored"
