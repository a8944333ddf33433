"""`GET /router/state` against the router's own server (router.proxy.cmd.build_server) and engines
that misbehave on purpose: an answer the engine cuts is an `error` of its worker and never
`answered`; a precise router whose index knows nothing predicts 0 cached tokens while the engine
says 8, so every compared answer is `under` by 8 tokens."""
from __future__ import annotations

import httpx
import pytest

from router.proxy.core import ProxyCore
from support.net import wait_until
from test_router_ops import PROMPT, RouterThread, engines, precise_router_over  # noqa: F401 (fixture)


def _settled(url: str, routed: int) -> dict:
    box: dict = {}

    def done() -> bool:
        box["s"] = s = httpx.get(f"{url}/router/state", timeout=10).json()
        return s["inflight"] == 0 and sum(w["answered"] + w["errors"] for w in s["workers"]) == routed
    wait_until(done, timeout=30, interval=0.05)
    return box["s"]


def test_a_cut_answer_is_an_error_of_its_worker(engines) -> None:  # noqa: F811
    cut = engines("cut", "cut")
    with RouterThread(lambda: ProxyCore({"cut": cut.url}, indexer=None, model="default", tokenizer=None,
                                        policy="round_robin")) as rt:
        with pytest.raises(httpx.RemoteProtocolError):
            with httpx.stream("POST", f"{rt.url}/v1/completions", json={**PROMPT, "stream": True}, timeout=10) as s:
                s.read()
        for _ in range(2):
            assert httpx.post(f"{rt.url}/v1/completions", json=PROMPT, timeout=10).status_code == 200
        s = _settled(rt.url, 3)
    (w,) = s["workers"]
    assert (w["worker_id"], w["routed"], w["unscored"], w["scored"], w["errors"], w["answered"]) == ("cut", 3, 3, 0, 1, 2)
    assert w["accuracy"]["compared"] == 0  # nothing was scored: nothing to compare
    assert s["counts"]["truncated"] == 1 and s["indexer"] is None and s["status"] == "degraded"
    assert s["decision_log"] == {"rate": 0.0, "samples": []}


def test_accuracy_counts_the_error_in_tokens(engines) -> None:  # noqa: F811
    eng = engines("e8", cached=8)
    with precise_router_over(eng, "e8") as (idx, rt):
        for i in range(3):
            r = httpx.post(f"{rt.url}/v1/completions", json={**PROMPT, "prompt": list(range(100 * i + 1, 100 * i + 41))},
                           timeout=10)
            assert r.status_code == 200 and "predicted_cached_tokens=0" in r.headers["x-kvatlas-route"]
        s = _settled(rt.url, 3)
    (w,) = s["workers"]
    assert (w["routed"], w["scored"], w["answered"]) == (3, 3, 3)
    assert w["accuracy"] == {"compared": 3, "exact": 0, "over": 0, "under": 3, "ratio": 0.0,
                             "mean_abs_error_tokens": 8.0}
    assert s["accuracy"]["under"] == 3 and s["indexer"]["ok"] is True
    (m,) = s["models"]
    assert m["model"] == "default" and m["accuracy"] == w["accuracy"] and m["decision_latency"]["n"] == 3
