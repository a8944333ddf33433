"""The router page of `kvatlas router --api openai` (docs/openai.md, "Router page"): `GET /` serves
one static HTML page (router/proxy/static/router.html: no build step, nothing fetched from elsewhere)
that polls `GET /router/state` once a second.

`router_state` is read from counters the router keeps anyway (router/proxy/core.py's counts,
in-flight counts and histograms, the load poller's worker states, the indexer client's state,
router/proxy/tally.py's per-model and per-worker counters and sampled decisions): a request pays
O(1) counter updates; a poll builds the state (about 2.5 ms with 300 workers) at most once per
STATE_TTL_S, however many pages poll. The answer is bounded: at most `top` workers (most routed and
in flight first), `top` models, the indexer's `top` most refused worker ids, the last `last`
sampled decisions, and every string cut at MAX_TEXT characters. Worker ids and reasons come from
other parties; the page renders every value as text, never as markup."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
from fastapi import FastAPI, Response
from fastapi.responses import HTMLResponse

from router.proxy.core import ProxyCore
from router.proxy.stats import _BOUNDS, Accuracy, Histogram
from router.proxy.tally import Cell

STATIC = Path(__file__).parent / "static" / "router.html"
TOP_WORKERS = 64
LAST_DECISIONS = 50
MAX_TEXT = 256
STATE_TTL_S = 0.25  # a state built (about 2.5 ms with 300 workers) serves every poll this long
_enc = msgspec.json.Encoder()


def clip(s: str, n: int = MAX_TEXT) -> str:
    return s if len(s) <= n else s[:n - 1] + "…"


def percentile_ms(h: Histogram, q: float) -> float | None:
    """The upper bound (ms) of the histogram bucket holding the q-quantile; None without
    observations or past the last bound."""
    if not h.n:
        return None
    want = q * h.n
    acc = 0
    for bound, c in zip(_BOUNDS, h.counts):
        acc += c
        if acc >= want:
            return bound * 1e3
    return None


def latency(h: Histogram) -> dict[str, Any]:
    return {"n": h.n, "mean_ms": h.total / h.n * 1e3 if h.n else None,
            "p50_ms": percentile_ms(h, 0.5), "p90_ms": percentile_ms(h, 0.9), "p99_ms": percentile_ms(h, 0.99)}


def accuracy(a: Accuracy) -> dict[str, Any]:
    """A tally's accuracy (the router's, or one (model, worker)'s) as the page shows it."""
    return {"compared": a.compared, "exact": a.exact, "over": a.over, "under": a.under, "ratio": a.ratio(),
            "mean_abs_error_tokens": a.abs_error_tokens / a.compared if a.compared else None}


def _cell_doc(c: Cell) -> dict[str, Any]:
    return {"routed": c.routed, "scored": c.scored, "unscored": c.unscored, "fallback": c.fallback,
            "errors": c.errors, "answered": c.answered,
            "accuracy": accuracy(c)}


def router_state(core: ProxyCore, *, top: int = TOP_WORKERS, last: int = LAST_DECISIONS,
                 now: float | None = None) -> dict[str, Any]:
    """The page's document (docs/openai.md, "Router page")."""
    tally = core.tally
    by_worker: dict[str, Cell] = {}
    by_model: dict[str, Cell] = {}
    models_of: dict[str, set[str]] = {}
    for (model, worker), c in list(tally.cells.items()):
        by_worker.setdefault(worker, Cell()).add(c)
        by_model.setdefault(model, Cell()).add(c)
        models_of.setdefault(worker, set()).add(model)
    idx = core.indexer
    unknown = {} if idx is None else idx.unknown_workers
    states = core.poller.states
    ids = set(states) | set(by_worker) | {w for w, n in core.inflight.items() if n}
    ranked = sorted(ids, key=lambda w: (-(by_worker[w].routed if w in by_worker else 0) - core.inflight.get(w, 0), w))
    workers = []
    for w in ranked[:max(0, top)]:
        st = states.get(w)
        c = by_worker.get(w) or Cell()
        load = None if st is None else st.load
        served = core.worker_models.get(w)
        workers.append({
            "worker_id": clip(w),
            "status": "unknown" if st is None or st.up is None else "up" if st.up else "down",
            "reason": "" if st is None else clip(st.reason),
            "engine": None if load is None else load.engine,
            "running": None if load is None else load.running,
            "waiting": None if load is None else load.waiting,
            "kv_usage": None if load is None else load.kv_usage,
            "poll_failures": 0 if st is None else st.failures,
            "unknown_at_indexer": unknown.get(w, 0),
            "models": sorted(clip(m) for m in (models_of.get(w) or ({served} if served else set())))[:8],
            "inflight": core.inflight.get(w, 0),
            **_cell_doc(c)})
    models = []
    for m in sorted(by_model, key=lambda m: (-by_model[m].routed, m))[:max(0, top)]:
        h = tally.latency.get(m)
        models.append({"model": clip(m), **_cell_doc(by_model[m]),
                       "decision_latency": latency(h if h is not None else Histogram())})
    status, why = core.health()
    samples = list(tally.samples)[-last:] if last > 0 else []
    at = time.time() if now is None else now
    return {
        "status": status, "why": [clip(w) for w in why[:16]], "policy": core.policy_name, "model": clip(core.model),
        "uptime_s": max(0.0, at - tally.started),
        "counts": dict(core.counts), "http_rejects": dict(core.http_rejects),
        "inflight": sum(n for n in core.inflight.values() if n > 0),
        "accuracy": accuracy(core.accuracy),
        "decision_latency": latency(core.decision_latency),
        "indexer_latency": latency(core.indexer_latency),
        "indexer": None if idx is None else {
            "url": clip(idx.url), "state": clip(idx.state), "ok": idx.state == "ok", "counts": dict(idx.counts),
            "unknown_workers": [{"worker_id": clip(w), "refused": n}
                                for w, n in sorted(unknown.items(), key=lambda kv: (-kv[1], kv[0]))[:max(0, top)]]},
        "workers_total": len(ids), "workers": workers, "models": models,
        "decision_log": {"rate": core.decision_log_rate, "samples": [
            {"age_s": max(0.0, at - s.at), "request_id": clip(s.request_id), "model": clip(s.model),
             "worker_id": clip(s.worker_id), "policy": s.policy, "prompt_tokens": s.prompt_tokens,
             "predicted": s.predicted, "served": s.served, "scored": s.scored,
             "unscored_reason": clip(s.unscored_reason), "decide_ms": s.decide_ms, "outcome": s.outcome}
            for s in reversed(samples)]}}


def mount_page(app: FastAPI, core: ProxyCore) -> None:
    """`GET /` (the page) and `GET /router/state` (its JSON) on the proxy's app."""
    html = STATIC.read_text(encoding="utf-8")

    @app.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(html, headers={"cache-control": "no-store",
                                           "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; "
                                                                      "style-src 'unsafe-inline'; connect-src 'self'"})

    cache: dict[tuple[int, int], tuple[float, bytes]] = {}

    @app.get("/router/state")
    async def state(top: int = TOP_WORKERS, last: int = LAST_DECISIONS) -> Response:
        key = (min(max(top, 0), TOP_WORKERS), min(max(last, 0), LAST_DECISIONS))
        now = time.monotonic()
        hit = cache.get(key)
        if hit is None or now - hit[0] >= STATE_TTL_S:  # many viewers (or a client looping) cost one build per TTL
            if len(cache) > 16:
                cache.clear()
            hit = cache[key] = (now, _enc.encode(router_state(core, top=key[0], last=key[1])))
        return Response(hit[1], media_type="application/json", headers={"cache-control": "no-store"})
