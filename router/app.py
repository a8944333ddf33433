"""The router's HTTP API: `POST /generate {token_ids, max_tokens}` routes and forwards one
request; `GET /report` (the per-request records so far, `?summary=1` for the table row);
`GET /health` (replay progress)."""
from __future__ import annotations

from typing import Annotated, Any

import msgspec
import numpy as np
from fastapi import FastAPI, Request, Response

from router_api.request_body import read_capped
from sim.httpbody import MAX_BODY_BYTES
from router.forwarder import RouterCore
from router.report import summarize
from schemas.api import TokenList

_enc = msgspec.json.Encoder()


class RouteRequest(msgspec.Struct, forbid_unknown_fields=True):
    token_ids: TokenList
    max_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 16


_dec = msgspec.json.Decoder(RouteRequest)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_enc.encode(obj), status_code=status, media_type="application/json")


def create_router_app(core: RouterCore, state: dict[str, Any], *, max_body_bytes: int = MAX_BODY_BYTES,
                      max_records: int = 100_000) -> FastAPI:
    app = FastAPI(title="kvatlas router", docs_url=None, redoc_url=None)
    counter = {"n": 1 << 40}  # ids of interactive requests, apart from trace indexes

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await read_capped(request, max_body_bytes)
        if body is None:
            return _json({"error": f"body exceeds the {max_body_bytes}-byte limit"}, 413)
        try:
            req = _dec.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return _json({"error": f"invalid request: {exc}"}, 422)
        if not req.token_ids or req.max_tokens < 0:
            return _json({"error": "token_ids must not be empty and max_tokens >= 0"}, 422)
        counter["n"] += 1
        rec, resp = await core.handle(counter["n"], np.asarray(req.token_ids, dtype=np.uint32), req.max_tokens)
        if len(core.records) > max_records:  # interactive records are kept bounded: the oldest go
            del core.records[:len(core.records) - max_records]
        if resp is None:
            return _json({"error": rec.error, "worker_id": rec.worker_id}, 502)
        return _json({"worker_id": rec.worker_id, "predicted_cached": rec.predicted_cached, "response": resp})

    @app.get("/report")
    async def report(summary: int = 0) -> Response:
        if summary:
            row = summarize(core.policy.name, 1, core.records)
            return _json({"state": state, "row": row})
        return _json({"policy": core.policy.name, "state": state, "records": core.records})

    @app.get("/health")
    async def health() -> Response:
        return _json({"status": "ok", "policy": core.policy.name, "route_errors": core.route_errors,
                      "indexer_unauthorized": core.unauthorized, **state})

    return app
