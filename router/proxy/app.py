"""The OpenAI-compatible HTTP front of `kvatlas router --api openai` (docs/openai.md):
`POST /v1/completions`, `POST /v1/chat/completions` (routed and proxied, SSE passed through),
`GET /v1/models` (from a live worker), `GET /health` (ok / degraded and why / no_worker),
`GET /metrics` (the router's own counters, latencies and live prediction accuracy). Every routed
answer carries `x-kvatlas-worker` and `x-kvatlas-route` (the decision).

A client that leaves before the answer begins cancels the upstream request (the engine frees its
slot); a streamed answer the client drops is closed upstream the same way. An upstream that breaks
off mid-answer cuts the client's connection (no clean end), so the client can tell.

Under `kvatlas router` the two routed paths are answered before this app by the server's own
protocol (router/proxy/front.py), by the same exchange (router/proxy/exchange.py); the app serves
them for whatever that protocol leaves to uvicorn (a query string, a pipelined request, ...).
"""
from __future__ import annotations

import asyncio
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from router.proxy.core import ProxyCore
from router.proxy.exchange import Refused, client_left, open_routed, parse, refused, too_large
from router.proxy.limits import MAX_BODY_BYTES
from router.proxy.page import mount_page
from router_api.request_body import read_capped

_enc = msgspec.json.Encoder()


def _error(status: int, message: str, kind: str = "BadRequestError") -> Response:
    return _answer(refused(status, message, kind))


def _answer(r: Refused) -> Response:
    return Response(r.body, status_code=r.status, media_type="application/json")


async def _client_gone(request: Request) -> None:
    """Returns once the client disconnects (the body is read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_proxy_app(core: ProxyCore, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="kvatlas router (OpenAI-compatible)", docs_url=None, redoc_url=None)

    async def proxied(request: Request, path: str, chat: bool) -> Response:
        core.counts["requests"] += 1
        raw = await read_capped(request, max_body_bytes)
        if raw is None:
            return _answer(too_large(max_body_bytes))
        body = parse(core, raw)
        if isinstance(body, Refused):
            return _answer(body)
        work = asyncio.ensure_future(open_routed(core, path, raw, body, request.headers.raw, chat))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():  # the client left first: cancel the upstream request (the engine stops)
                work.cancel()
                core.counts["client_gone"] += 1
            gone.cancel()
        try:
            got = await work
        except asyncio.CancelledError:
            return _answer(client_left())
        if isinstance(got, Refused):
            return _answer(got)
        return StreamingResponse(got.chunks, status_code=got.status, headers=got.headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxied(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxied(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        auth = request.headers.get("authorization")
        for w in core.poller.up():
            try:
                r = await core.client.get(f"{core.workers[w]}/v1/models", timeout=5.0,
                                          headers={"authorization": auth} if auth else None)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type", "application/json"))
        return _error(503, "no worker is up", "ServiceUnavailable")

    @app.get("/health")
    async def health() -> Response:
        status, why = core.health()
        acc = core.accuracy
        doc: dict[str, Any] = {
            "status": status, "why": why, "policy": core.policy_name,
            "indexer": None if core.indexer is None else {"url": core.indexer.url, "state": core.indexer.state,
                                                          "unknown_workers": core.indexer.unknown_workers},
            "prediction": {"compared": acc.compared, "exact": acc.exact, "accuracy": acc.ratio()},
            "workers": {w: {"up": bool(st.up), "reason": st.reason, "engine": st.load.engine,
                            "running": st.load.running, "waiting": st.load.waiting,
                            "kv_usage": st.load.kv_usage, "inflight": core.inflight.get(w, 0)}
                        for w, st in core.poller.states.items()}, **core.extra_health}
        return Response(_enc.encode(doc), status_code=503 if status == "no_worker" else 200,
                        media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(metrics_text(core), media_type="text/plain; version=0.0.4")

    mount_page(app, core)  # GET / and GET /router/state
    return app


def metrics_text(core: ProxyCore) -> str:
    lines = ["# TYPE kvatlas_router_requests_total counter"]
    lines += [f'kvatlas_router_requests_total{{outcome="{k}"}} {v}' for k, v in core.counts.items()]
    lines.append("# TYPE kvatlas_router_http_rejects_total counter")
    lines += [f'kvatlas_router_http_rejects_total{{reason="{k}"}} {v}' for k, v in sorted(core.http_rejects.items())]
    lines.append("# TYPE kvatlas_router_worker_up gauge")
    for w, st in core.poller.states.items():
        lines.append(f'kvatlas_router_worker_up{{worker="{w}"}} {1 if st.up else 0}')
    lines.append("# TYPE kvatlas_router_routed_total counter")
    lines += [f'kvatlas_router_routed_total{{worker="{w}"}} {n}' for w, n in core.routed_to.items()]
    lines.append("# TYPE kvatlas_router_inflight gauge")
    lines += [f'kvatlas_router_inflight{{worker="{w}"}} {n}' for w, n in core.inflight.items()]
    lines.append("# TYPE kvatlas_router_worker_waiting gauge")
    lines += [f'kvatlas_router_worker_waiting{{worker="{w}"}} {st.load.waiting}'
              for w, st in core.poller.states.items() if st.load.waiting is not None]
    lines += core.decision_latency.lines("kvatlas_router_decision_seconds")
    lines += core.indexer_latency.lines("kvatlas_router_indexer_call_seconds")
    lines += core.accuracy.lines()
    idx = core.indexer
    if idx is not None:
        lines.append("# TYPE kvatlas_router_indexer_calls_total counter")
        lines += [f'kvatlas_router_indexer_calls_total{{outcome="{k}"}} {v}' for k, v in idx.counts.items()]
        lines.append("# TYPE kvatlas_router_indexer_up gauge")
        lines.append(f"kvatlas_router_indexer_up {1 if idx.state == 'ok' else 0}")
        lines.append("# TYPE kvatlas_router_route_refused_total counter")
        lines += [f'kvatlas_router_route_refused_total{{worker="{w}"}} {n}' for w, n in idx.unknown_workers.items()]
    return "\n".join(lines) + "\n"
