"""`kvatlas router` in OpenAI mode: the HTTP front (docs/openai.md).

`POST /v1/completions`, `POST /v1/chat/completions` (streaming or not: the engine's bytes pass
through unchanged), `GET /v1/models` (the first worker that is up answers), `GET /health`
(200 while a worker is up, else 503, with each worker's state), `GET /metrics` (the router's own).
Every routed answer carries `x-kvatlas-worker` and `x-kvatlas-route` (the decision).
"""
from __future__ import annotations

from typing import Any

import httpx
import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from sim.httpbody import MAX_BODY_BYTES, read_capped
from router_api.proxy.core import NoWorker, ProxyCore

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()


def _error(status: int, message: str, kind: str = "BadRequestError") -> Response:
    # OpenAI's error shape, so client libraries raise their usual exception
    return Response(_enc.encode({"error": {"message": message, "type": kind, "code": status}}), status_code=status,
                    media_type="application/json")


def create_proxy_app(core: ProxyCore, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="kvatlas router (OpenAI-compatible)", docs_url=None, redoc_url=None)

    async def proxied(request: Request, path: str, chat: bool) -> Response:
        core.counts["requests"] += 1
        raw = await read_capped(request, max_body_bytes)
        if raw is None:
            return _error(413, f"body exceeds the {max_body_bytes}-byte limit")
        try:
            body = _dec.decode(raw)
        except msgspec.DecodeError as exc:
            return _error(400, f"malformed JSON body: {exc}")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        try:
            route = await core.route(body, chat)
            resp = await core.forward(path, raw, body, request.headers.raw, route, chat)
        except NoWorker as exc:
            core.counts["no_worker"] += 1
            return _error(503, str(exc), "ServiceUnavailable")
        return StreamingResponse(core.relay(resp, route), status_code=resp.status_code,
                                 headers=core.response_headers(resp, route))

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
        up = core.poller.up()
        doc: dict[str, Any] = {"status": "ok" if up else "no_worker", "policy": core.policy_name,
                               "workers": {w: {"up": bool(st.up), "reason": st.reason, "engine": st.load.engine,
                                               "running": st.load.running, "waiting": st.load.waiting,
                                               "kv_usage": st.load.kv_usage, "inflight": core.inflight[w]}
                                           for w, st in core.poller.states.items()}}
        return Response(_enc.encode(doc), status_code=200 if up else 503, media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(metrics_text(core), media_type="text/plain; version=0.0.4")

    return app


def metrics_text(core: ProxyCore) -> str:
    lines = ["# TYPE kvatlas_router_requests_total counter"]
    lines += [f'kvatlas_router_requests_total{{outcome="{k}"}} {v}' for k, v in core.counts.items()]
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
    return "\n".join(lines) + "\n"
