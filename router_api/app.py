"""FastAPI app around an IndexerService. `create_app(service)` — no globals.

Hot paths read the raw body and decode it with msgspec (JSON, msgpack or raw little-endian u32
tokens), so large token lists never go through pydantic. Every error is JSON `{"error": msg}`;
bodies above the limit get 413 before any parsing; bad input is counted per endpoint and reason.
"""
from __future__ import annotations

import hmac
import logging
import time
from pathlib import Path
from typing import Any, Callable

import msgspec
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from router_api.registry import RegistryError
from router_api.service import IndexerService, UnknownModel
from schemas.api import (
    MAX_QUERY_TOKENS,
    ErrorResponse,
    QueryRequest,
    RegisterWorker,
    ScoreRequest,
)

log = logging.getLogger("kvatlas.http")

STATIC_DIR = Path(__file__).resolve().parent / "static"
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
_json = msgspec.json.Encoder()
_msgpack = msgspec.msgpack.Encoder()
_dec_json: dict[type, msgspec.json.Decoder[Any]] = {
    t: msgspec.json.Decoder(t) for t in (ScoreRequest, QueryRequest, RegisterWorker)
}
_dec_msgpack: dict[type, msgspec.msgpack.Decoder[Any]] = {
    t: msgspec.msgpack.Decoder(t) for t in (ScoreRequest, QueryRequest, RegisterWorker)
}


class ApiError(Exception):
    """An error answered as JSON; `reason` labels the reject counter."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(ErrorResponse(error=message)), status_code=status,
                    media_type="application/json", headers=headers)


class BearerAuth:
    """Pure ASGI middleware: every path but /health needs `Authorization: Bearer <token>`.
    The dashboard page (`GET /`) may also carry it as `?token=` since a browser cannot set headers
    on navigation; the page then sends the header on its own requests."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.expected = b"Bearer " + token.encode()
        self.token = token.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        ok = False
        for k, v in scope.get("headers") or ():
            if k == b"authorization":
                ok = hmac.compare_digest(v, self.expected)
                break
        if not ok and scope["path"] == "/" and scope.get("query_string"):
            from urllib.parse import parse_qs

            qs = parse_qs(scope["query_string"].decode("latin-1"))
            tok = (qs.get("token") or [""])[0].encode()
            ok = bool(tok) and hmac.compare_digest(tok, self.token)
        if ok:
            await self.app(scope, receive, send)
            return
        resp = _error(401, "missing or invalid bearer token", {"WWW-Authenticate": "Bearer"})
        await resp(scope, receive, send)


def create_app(service: IndexerService) -> FastAPI:
    cfg = service.config
    metrics = service.metrics
    max_body = cfg.max_body_bytes
    dashboard_html = (STATIC_DIR / "dashboard.html").read_text(encoding="utf-8")

    app = FastAPI(title="kvatlas indexer", version="0.1.0", docs_url="/docs", redoc_url=None)
    if cfg.auth_token:
        app.add_middleware(BearerAuth, token=cfg.auth_token)

    def reject(endpoint: str, exc: ApiError) -> Response:
        metrics.http_rejects.inc(endpoint, exc.reason)
        return _error(exc.status, exc.message)

    async def read_body(request: Request) -> bytes:
        cl = request.headers.get("content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                raise ApiError(400, "invalid Content-Length", "bad_header") from None
            if n > max_body:
                raise ApiError(413, f"body of {n} bytes exceeds the {max_body}-byte limit", "too_large")
        chunks: list[bytes] = []
        total = 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > max_body:
                raise ApiError(413, f"body exceeds the {max_body}-byte limit", "too_large")
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def content_kind(request: Request) -> str:
        ctype = request.headers.get("content-type", "application/json").split(";", 1)[0].strip().lower()
        if ctype in ("application/json", "", "text/json"):
            return "json"
        if ctype in MSGPACK_TYPES:
            return "msgpack"
        if ctype == "application/octet-stream":
            return "octet"
        raise ApiError(415, f"unsupported content type {ctype!r}: use application/json, "
                            "application/msgpack or application/octet-stream", "bad_content_type")

    def decode(kind: str, body: bytes, typ: type) -> Any:
        if not body:
            raise ApiError(400, "empty body", "empty_body")
        try:
            if kind == "json":
                return _dec_json[typ].decode(body)
            return _dec_msgpack[typ].decode(body)
        except msgspec.ValidationError as exc:
            raise ApiError(422, f"invalid request: {exc}", "invalid") from None
        except msgspec.DecodeError as exc:
            reason = "bad_json" if kind == "json" else "bad_msgpack"
            raise ApiError(400, f"malformed {kind} body: {exc}", reason) from None

    def octet_tokens(body: bytes) -> np.ndarray:
        if len(body) % 4:
            raise ApiError(422, f"octet-stream body of {len(body)} bytes is not a whole number of "
                                "little-endian u32 tokens", "invalid")
        if len(body) // 4 > MAX_QUERY_TOKENS:
            raise ApiError(422, f"{len(body) // 4} tokens exceeds the {MAX_QUERY_TOKENS}-token limit",
                           "invalid")
        return np.frombuffer(body, dtype="<u4")

    def encode_for(request: Request, obj: Any, status: int = 200) -> Response:
        accept = request.headers.get("accept", "")
        if "msgpack" in accept:
            return Response(_msgpack.encode(obj), status_code=status, media_type="application/msgpack")
        return Response(_json.encode(obj), status_code=status, media_type="application/json")

    def observe(endpoint: str, t0: float) -> None:
        dt = time.perf_counter() - t0
        metrics.request_latency.observe(dt, endpoint)
        if endpoint == "score":
            metrics.recent_score.add(dt)

    async def parse_query(request: Request, typ: type) -> tuple[str, Any, str | None, str | None]:
        kind = content_kind(request)
        body = await read_body(request)
        if kind == "octet":
            qp = request.query_params
            model = qp.get("model") or qp.get("model_name") or cfg.model
            return model, octet_tokens(body), qp.get("lora_name") or None, qp.get("cache_salt") or None
        req = decode(kind, body, typ)
        if typ is QueryRequest:
            model = req.model_name or req.model or cfg.model
        else:
            model = req.model
        return model, req.token_ids, req.lora_name, req.cache_salt

    @app.post("/score")
    async def score(request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            model, tokens, lora, salt = await parse_query(request, ScoreRequest)
            res = service.score(model, tokens, lora, salt)
        except ApiError as exc:
            return reject("score", exc)
        except UnknownModel as exc:
            return reject("score", ApiError(404, str(exc), "unknown_model"))
        resp = encode_for(request, res)
        observe("score", t0)
        return resp

    @app.post("/query")
    async def query(request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            model, tokens, lora, salt = await parse_query(request, QueryRequest)
            res = service.query_compat(model, tokens, lora, salt)
        except ApiError as exc:
            return reject("query", exc)
        except UnknownModel as exc:
            return reject("query", ApiError(404, str(exc), "unknown_model"))
        resp = encode_for(request, res)
        observe("query", t0)
        return resp

    @app.post("/workers")
    async def register(request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            kind = content_kind(request)
            if kind == "octet":
                raise ApiError(415, "register with a JSON or msgpack body", "bad_content_type")
            reg = decode(kind, await read_body(request), RegisterWorker)
            status = service.register(reg)
        except ApiError as exc:
            return reject("register", exc)
        except RegistryError as exc:
            return reject("register", ApiError(exc.status, str(exc), type(exc).__name__.lower()))
        observe("register", t0)
        return encode_for(request, status, 201)

    @app.delete("/workers/{worker_id}")
    async def unregister(worker_id: str) -> Response:
        try:
            service.unregister(worker_id)
        except RegistryError as exc:
            metrics.http_rejects.inc("unregister", "unknown_worker")
            return _error(exc.status, str(exc))
        return Response(_json.encode({"removed": worker_id}), media_type="application/json")

    @app.get("/workers")
    async def workers(request: Request) -> Response:
        return encode_for(request, service.workers())

    @app.get("/health")
    async def health() -> Response:
        return Response(_json.encode(service.health()), media_type="application/json")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(service.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats() -> Response:
        return Response(_json.encode(service.stats()), media_type="application/json")

    @app.get("/dump")
    async def dump(request: Request) -> Response:
        return encode_for(request, service.dump())

    @app.get("/", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(dashboard_html)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        metrics.http_rejects.inc(request.url.path, "internal_error")
        log.exception("event=internal_error path=%s", request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    return app
