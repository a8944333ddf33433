"""HTTP app around an IndexerService. `create_app(service)` — no globals.

The hot endpoints (`POST /score`, `POST /query`) are served by a pure ASGI front (`ScoreFront`)
ahead of FastAPI: it reads the raw body and decodes it with cached msgspec decoders (JSON, msgpack,
or raw little-endian u32 tokens viewed with `np.frombuffer`, no list), and answers with bytes the
service writes (`/score`: in C, router_api/answer.py) or cached encoders — no routing, dependency
solving or Request/Response objects per query. With the native module, JSON / msgpack `token_ids`
are parsed into a u32 buffer in C in one pass over the body (`TokenBodies`), so no Python int is
made per token. Everything else goes through FastAPI.
Every error is JSON `{"error": msg}`; bodies above the limit get 413 before any parsing; bad
input is counted per endpoint and reason. The bearer check wraps both.
"""
from __future__ import annotations

import hmac
import logging
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qsl

import msgspec
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from indexer.core import native as native_core
from router_api.metrics import CONTENT_TYPE_LATEST
from router_api import score_text
from router_api.registry import RegistryError
from router_api.routes import UnknownRouteWorker
from router_api.service import IndexerService, UnknownModel
from schemas.api import (
    MAX_QUERY_TOKENS,
    ErrorResponse,
    QueryRequest,
    QueryRequestRaw,
    QueryResponse,
    RegisterWorker,
    RouteRelease,
    RouteReport,
    ScoreRequest,
    ScoreRequestRaw,
    ScoreResponse,
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
_dec_json[RouteReport] = msgspec.json.Decoder(RouteReport)
_dec_msgpack[RouteReport] = msgspec.msgpack.Decoder(RouteReport)
_RAW_TWIN: dict[type, type] = {ScoreRequest: ScoreRequestRaw, QueryRequest: QueryRequestRaw}
_dec_raw: dict[tuple[str, type], Any] = {
    ("json", t): msgspec.json.Decoder(r) for t, r in _RAW_TWIN.items()} | {
    ("msgpack", t): msgspec.msgpack.Decoder(r) for t, r in _RAW_TWIN.items()}


ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]
_JSON_HEADERS = (b"content-type", b"application/json")
_MSGPACK_HEADERS = (b"content-type", b"application/msgpack")
# (endpoint label, request type, handler): handler(model, tokens, lora_name, cache_salt, msgpack) -> answer bytes
Route = tuple[str, type, Callable[..., bytes]]
Answer = tuple[int, bytes, tuple[bytes, bytes]]  # (status, body, content-type header)


class ApiError(Exception):
    """An error answered as JSON; `reason` labels the reject counter. `loud`: also worth a log
    line (through the app's rate limiter), e.g. a body built to exhaust the decoder's stack."""

    def __init__(self, status: int, message: str, reason: str, loud: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.loud = loud


TOO_DEEP = "body nested too deeply"


def _too_deep() -> ApiError:
    return ApiError(400, f"malformed body: {TOO_DEEP}", "too_deep", loud=True)


class RateLimitedLog:
    """At most one line per `interval_s` per key; the lines suppressed meanwhile are counted in
    the next one. Owned by one app (no global state); the clock is injectable for tests."""

    __slots__ = ("interval_s", "clock", "_next", "_suppressed")

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: Any) -> bool:
        now = self.clock()
        if now < self._next.get(key, 0.0):
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._next[key] = now + self.interval_s
        n = self._suppressed.pop(key, 0)
        log.warning(msg + " suppressed_since_last=%d", *args, n)
        return True


def escape_log(value: object) -> str:
    """A value safe inside one text log line: control characters (newlines too) are escaped."""
    text = str(value)
    if text.isprintable():
        return text
    return text.encode("unicode_escape").decode("ascii")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(ErrorResponse(error=message)), status_code=status,
                    media_type="application/json", headers=headers)


def content_kind(ctype: str) -> str:
    """"json" | "msgpack" | "octet" for a Content-Type header value; ApiError(415) otherwise."""
    ctype = ctype.split(";", 1)[0].strip().lower()
    if ctype in ("application/json", "", "text/json"):
        return "json"
    if ctype in MSGPACK_TYPES:
        return "msgpack"
    if ctype == "application/octet-stream":
        return "octet"
    raise ApiError(415, f"unsupported content type {ctype!r}: use application/json, "
                        "application/msgpack or application/octet-stream", "bad_content_type")


def decode_body(kind: str, body: bytes, typ: type) -> Any:
    if not body:
        raise ApiError(400, "empty body", "empty_body")
    try:
        if kind == "json":
            return _dec_json[typ].decode(body)
        return _dec_msgpack[typ].decode(body)
    except RecursionError:  # msgspec's nesting limit: the client's fault, not a 500
        raise _too_deep() from None
    except msgspec.ValidationError as exc:
        raise ApiError(422, f"invalid request: {exc}", "invalid") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # msgspec: invalid UTF-8 in a string
        reason = "bad_json" if kind == "json" else "bad_msgpack"
        raise ApiError(400, f"malformed {kind} body: {exc}", reason) from None


# A body holding token_ids and nothing else, up to the array (msgspec's and most clients' spelling).
_BARE_JSON = b'{"token_ids":'
_BARE_MSGPACK = b"\x81" + msgspec.msgpack.encode("token_ids")


class TokenBodies:
    """Decodes a /score or /query body to (request, token_ids). With the native module the tokens
    come back as a u32 numpy buffer parsed in C from the raw array; whenever the fast path cannot
    decide (any invalid or unusual input) the typed msgspec decoder judges the body, so statuses and
    messages are the pure-Python path's, word for word. Without it (or KVATLAS_PURE_PYTHON=1),
    that typed decoder is the only path and token_ids is a list of ints."""

    __slots__ = ("native", "msgpack_bodies")

    def __init__(self, native: bool | None = None) -> None:
        self.native: ModuleType | None = native_core.select(native)
        if self.native is not None and not hasattr(self.native, "json_body_u32"):
            self.native = None  # a stale build without the body parsers: the Python path serves
        self.msgpack_bodies = self.native is not None and hasattr(self.native, "msgpack_body_u32")

    def decode(self, kind: str, body: bytes, typ: type) -> tuple[Any, Any]:
        mod = self.native
        if mod is not None and body and (kind == "json" or (kind == "msgpack" and self.msgpack_bodies)):
            # One C pass finds and parses the token array; the typed decoder then judges the rest
            # of the body with that array replaced by an empty one (a few bytes, not a second full scan).
            js = kind == "json"
            found = mod.json_body_u32(body, MAX_QUERY_TOKENS) if js else mod.msgpack_body_u32(body, MAX_QUERY_TOKENS)
            if found is not None:
                buf, a, b = found
                if b == len(body) - (1 if js else 0) and body[:a] == (_BARE_JSON if js else _BARE_MSGPACK):
                    req = typ([])  # the body is token_ids alone: what the typed decoder would make of the rest
                else:
                    try:
                        req = (_dec_json if js else _dec_msgpack)[typ].decode(body[:a] + (b"[]" if js else b"\x90") + body[b:])
                    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
                        req = None  # judged below on the whole body, so the wording is the usual one
                if req is not None:
                    return req, np.frombuffer(buf, dtype="<u4")
        # The Raw twin keeps only the last of repeated keys, unvalidated, where the typed decoder
        # judges each occurrence: a body naming token_ids twice (or with a JSON escape that could
        # spell it) is left to the typed decoder.
        if mod is not None and body and body.count(b"token_ids") == 1 and (kind != "json" or b"\\" not in body):
            try:
                req = _dec_raw[kind, typ].decode(body)
            except (msgspec.DecodeError, UnicodeDecodeError):  # incl. ValidationError: the typed decoder words it
                req = None
            except RecursionError:
                raise _too_deep() from None
            if req is not None:
                parse = mod.json_u32_array if kind == "json" else mod.msgpack_u32_array
                buf = parse(req.token_ids, MAX_QUERY_TOKENS)
                if buf is not None:
                    return req, np.frombuffer(buf, dtype="<u4")
        req = decode_body(kind, body, typ)
        return req, req.token_ids


def octet_tokens(body: bytes) -> np.ndarray:
    """Raw little-endian u32 tokens, viewed in place (no copy, no Python ints); empty = no tokens."""
    if len(body) % 4:
        raise ApiError(422, f"octet-stream body of {len(body)} bytes is not a whole number of "
                            "little-endian u32 tokens", "invalid")
    if len(body) // 4 > MAX_QUERY_TOKENS:
        raise ApiError(422, f"{len(body) // 4} tokens exceeds the {MAX_QUERY_TOKENS}-token limit",
                       "invalid")
    return np.frombuffer(body, dtype="<u4")


def check_length(value: str | bytes | None, max_body: int) -> None:
    """A declared Content-Length above the limit is refused before any body is read."""
    if value is None:
        return
    try:
        n = int(value)
    except ValueError:
        raise ApiError(400, "invalid Content-Length", "bad_header") from None
    if n > max_body:
        raise ApiError(413, f"body of {n} bytes exceeds the {max_body}-byte limit", "too_large")


class _ClientGone(Exception):
    """The client disconnected before sending its whole body: nothing to answer."""


class ScoreFront:
    """Pure ASGI front serving `/score` and `/query` without the framework; every other request
    goes to `app` (FastAPI). `prepare` + `answer` are the one validation / negotiation path of the
    two endpoints: this front, the uvicorn protocol fast path (`router_api.fasthttp`) and the
    FastAPI routes that document them in OpenAPI all call them (docs/service.md, "HTTP stack")."""

    __slots__ = ("app", "service", "metrics", "max_body", "default_model", "routes", "fastapi", "bodies",
                 "limiter", "token", "_kinds")

    def __init__(self, app: ASGIApp, service: IndexerService, native: bool | None = None,
                 limiter: RateLimitedLog | None = None) -> None:
        self.app = app
        self.limiter = limiter if limiter is not None else RateLimitedLog()
        self.bodies = TokenBodies(native)
        self.fastapi = app
        self.service = service
        self.metrics = service.metrics
        self.max_body = service.config.max_body_bytes
        self.default_model = service.config.model
        self.token: bytes | None = None  # set by BearerAuth: the fast path checks it too
        self._kinds: dict[bytes | None, str] = {}  # Content-Type value -> body kind (content_kind), accepted ones
        self.routes: dict[str, Route] = {
            "/score": ("score", ScoreRequest, service.score_answer),  # answer bytes written in C when it can
            "/query": ("query", QueryRequest, _encoded(service.query_compat))}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            await _send(send, 405, _json.encode(ErrorResponse(error="method not allowed: use POST")),
                        _JSON_HEADERS, ((b"allow", b"POST"),))
            return
        t0 = time.perf_counter()
        ctype = accept = clen = None
        for k, v in scope["headers"]:
            if k == b"content-type":
                ctype = v
            elif k == b"accept":
                accept = v
            elif k == b"content-length":
                clen = v
        try:
            kind = self.prepare(ctype, clen)
            body = await self._read(receive)
        except _ClientGone:
            return
        except ApiError as exc:
            await _send(send, *self.rejected(route[0], exc))
            return
        await _send(send, *self.answer(route, kind, accept, scope["query_string"], body, t0))

    def prepare(self, ctype: bytes | None, clen: bytes | None) -> str:
        """Before any body byte: the body kind from Content-Type; 413 for a declared length over the limit."""
        kind = self._kinds.get(ctype)
        if kind is None:
            kind = content_kind("application/json" if ctype is None else ctype.decode("latin-1"))
            if len(self._kinds) < 32:  # a client's few spellings; bounded against a spray of them
                self._kinds[ctype] = kind
        check_length(clen, self.max_body)
        return kind

    def health(self) -> Answer:
        """`GET /health`, the same bytes the FastAPI route answers (for the protocol fast path)."""
        return 200, _json.encode(self.service.health()), _JSON_HEADERS

    def rejected(self, endpoint: str, exc: ApiError) -> Answer:
        self.metrics.http_rejects.inc(endpoint, exc.reason)
        if exc.loud:
            self.limiter.warning(exc.reason, "event=rejected endpoint=%s reason=%s status=%d",
                                 endpoint, exc.reason, exc.status)
        return exc.status, _json.encode(ErrorResponse(error=exc.message)), _JSON_HEADERS

    def answer(self, route: Route, kind: str, accept: bytes | None, query_string: bytes, body: bytes,
               t0: float) -> Answer:
        """(status, body, content-type header) for a whole request body; never raises."""
        endpoint, typ, handler = route
        mp = accept is not None and b"msgpack" in accept
        try:
            if kind == "octet":
                qp = dict(parse_qsl(query_string.decode("latin-1"), keep_blank_values=True)) if query_string else {}
                model = qp.get("model") or qp.get("model_name") or self.default_model
                out = handler(model, octet_tokens(body), qp.get("lora_name") or None, qp.get("cache_salt") or None, mp)
            else:
                req, tokens = self.bodies.decode(kind, body, typ)
                if typ is QueryRequest:
                    model = req.model_name or req.model or self.default_model
                    out = handler(model, tokens, req.lora_name, req.cache_salt, mp)
                elif score_text.is_text(tokens, req.prompt, req.messages):  # prompt / messages: tokenized here
                    out = score_text.text_answer(self.service, req.model, req, mp)
                else:
                    out = handler(req.model, tokens, req.lora_name, req.cache_salt, mp)
        except ApiError as exc:
            return self.rejected(endpoint, exc)
        except score_text.TextInputError as exc:
            return self.rejected(endpoint, ApiError(exc.status, exc.message, exc.reason))
        except UnknownModel as exc:
            self.metrics.http_rejects.inc(endpoint, "unknown_model")
            return 404, _json.encode(ErrorResponse(error=str(exc))), _JSON_HEADERS
        except Exception as exc:  # a bug must answer 500 and be counted, never kill the connection
            path = "/" + endpoint
            self.metrics.http_rejects.inc(path, "internal_error")
            log.exception("event=internal_error path=%s", path)
            return 500, _json.encode(ErrorResponse(error=f"internal error: {type(exc).__name__}: {exc}")), \
                _JSON_HEADERS
        dt = time.perf_counter() - t0
        self.metrics.request_latency.observe(dt, endpoint)
        if endpoint == "score":
            self.metrics.recent_score.add(dt)
        return 200, out, _MSGPACK_HEADERS if mp else _JSON_HEADERS

    async def _read(self, receive: Callable) -> bytes:
        """The whole body; 413 as soon as it passes the limit (whatever Content-Length said)."""
        msg = await receive()
        if msg["type"] != "http.request":
            raise _ClientGone
        body = msg.get("body", b"")
        if not msg.get("more_body", False):  # the common case: one message, no copy
            if len(body) > self.max_body:
                raise ApiError(413, f"body exceeds the {self.max_body}-byte limit", "too_large")
            return body
        buf = bytearray(body)
        while True:
            if len(buf) > self.max_body:
                raise ApiError(413, f"body exceeds the {self.max_body}-byte limit", "too_large")
            msg = await receive()
            if msg["type"] != "http.request":
                raise _ClientGone
            buf += msg.get("body", b"")
            if not msg.get("more_body", False):
                break
        if len(buf) > self.max_body:
            raise ApiError(413, f"body exceeds the {self.max_body}-byte limit", "too_large")
        return bytes(buf)


def _encoded(handler: Callable[..., Any]) -> Callable[..., bytes]:
    """A service handler answering a Struct, as a route handler answering its JSON or msgpack bytes."""
    def answer(model: str, tokens: Any, lora_name: str | None, cache_salt: str | None, mp: bool) -> bytes:
        return (_msgpack if mp else _json).encode(handler(model, tokens, lora_name, cache_salt))
    return answer


async def _send(send: Callable, status: int, body: bytes, ctype: tuple[bytes, bytes],
                extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [ctype, (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})


def bearer_ok(headers: Any, token: bytes) -> bool:
    """`Authorization: Bearer <token>` among the (lower-case name, value) pairs."""
    for k, v in headers:
        if k == b"authorization":
            # The scheme is case-insensitive (RFC 9110 §11.1); the token is compared exactly.
            scheme, _, cred = v.strip().partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(cred.strip(), token)
    return False


class BearerAuth:
    """Pure ASGI middleware: every path but /health needs `Authorization: Bearer <token>`.
    The dashboard page (`GET /`) may also carry it as `?token=` since a browser cannot set headers
    on navigation; the page then sends the header on its own requests."""

    __slots__ = ("app", "fastapi", "token", "front")

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.fastapi = getattr(app, "fastapi", app)
        self.token = token.encode()
        self.front: ScoreFront | None = app if isinstance(app, ScoreFront) else None
        if self.front is not None:
            self.front.token = self.token

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        ok = bearer_ok(scope.get("headers") or (), self.token)
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


def create_app(service: IndexerService, native_bodies: bool | None = None) -> ASGIApp:
    """The service's ASGI app: bearer check (when configured) -> ScoreFront -> FastAPI.
    The FastAPI app itself is reachable as `.fastapi` on the result. `native_bodies` picks the
    /score body decoder like `indexer.core.native.select` (None: native when built)."""
    cfg = service.config
    metrics = service.metrics
    max_body = cfg.max_body_bytes
    dashboard_html = (STATIC_DIR / "dashboard.html").read_text(encoding="utf-8")

    app = FastAPI(title="kvatlas indexer", version="0.1.0", docs_url="/docs", redoc_url=None)

    limiter = RateLimitedLog()

    def reject(endpoint: str, exc: ApiError) -> Response:
        metrics.http_rejects.inc(endpoint, exc.reason)
        if exc.loud:
            limiter.warning(exc.reason, "event=rejected endpoint=%s reason=%s status=%d", endpoint,
                            exc.reason, exc.status)
        return _error(exc.status, exc.message)

    async def read_body(request: Request) -> bytes:
        check_length(request.headers.get("content-length"), max_body)
        chunks: list[bytes] = []
        total = 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > max_body:
                raise ApiError(413, f"body exceeds the {max_body}-byte limit", "too_large")
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def encode_for(request: Request, obj: Any, status: int = 200) -> Response:
        accept = request.headers.get("accept", "")
        if "msgpack" in accept:
            return Response(_msgpack.encode(obj), status_code=status, media_type="application/msgpack")
        return Response(_json.encode(obj), status_code=status, media_type="application/json")

    def observe(endpoint: str, t0: float) -> None:
        metrics.request_latency.observe(time.perf_counter() - t0, endpoint)

    @app.post("/workers")
    async def register(request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            kind = content_kind(request.headers.get("content-type", "application/json"))
            if kind == "octet":
                raise ApiError(415, "register with a JSON or msgpack body", "bad_content_type")
            reg = decode_body(kind, await read_body(request), RegisterWorker)
            # Off the event loop: it resolves host names and waits for the subscription.
            status = await run_in_threadpool(service.register, reg)
            if service.plane is not None:  # `--nats`: every replica follows it (docs/jetstream.md)
                await run_in_threadpool(service.plane.publish, reg)
        except ApiError as exc:
            return reject("register", exc)
        except RegistryError as exc:
            return reject("register", ApiError(exc.status, str(exc), type(exc).__name__.lower()))
        observe("register", t0)
        return encode_for(request, status, 201)

    @app.delete("/workers/{worker_id:path}")
    async def unregister(worker_id: str) -> Response:
        try:
            service.unregister(worker_id)
            if service.plane is not None:
                await run_in_threadpool(service.plane.withdraw, worker_id)
        except RegistryError as exc:
            metrics.http_rejects.inc("unregister", "unknown_worker")
            return _error(exc.status, str(exc))
        return Response(_json.encode({"removed": worker_id}), media_type="application/json")

    @app.post("/routes")
    async def report_route(request: Request) -> Response:
        """A router's decision: the request's blocks count as pending on that worker (docs/CONTRACTS.md)."""
        t0 = time.perf_counter()
        try:
            kind = content_kind(request.headers.get("content-type", "application/json"))
            if kind == "octet":
                raise ApiError(415, "report a route with a JSON or msgpack body", "bad_content_type")
            r = decode_body(kind, await read_body(request), RouteReport)
            answer = service.report_route(r.model, r.request_id, r.worker_id, r.token_ids, r.dp_rank,
                                          r.lora_name, r.cache_salt)
        except ApiError as exc:
            return reject("routes", exc)
        except (UnknownModel, UnknownRouteWorker) as exc:
            return reject("routes", ApiError(404, str(exc).strip("'\""), "unknown_worker"))
        observe("routes", t0)
        return encode_for(request, answer)

    @app.delete("/routes/{request_id:path}")
    async def release_route(request: Request, request_id: str, model: str = "default") -> Response:
        return encode_for(request, RouteRelease(service.release_route(model, request_id)))

    @app.get("/workers")
    async def workers(request: Request) -> Response:
        return encode_for(request, service.workers())

    @app.get("/health")
    async def health() -> Response:
        return Response(_json.encode(service.health()), media_type="application/json")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(service.metrics_text(), media_type=CONTENT_TYPE_LATEST)

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

    front: Any = ScoreFront(app, service, native_bodies, limiter)

    async def served(request: Request, route: Route) -> Response:
        """/score and /query through FastAPI: the front's own path (reached when the app is mounted
        without the front, e.g. `create_app(...).fastapi`); the routes also document the two in OpenAPI."""
        t0 = time.perf_counter()
        h = request.headers
        try:
            kind = front.prepare(_hb(h.get("content-type")), _hb(h.get("content-length")))
            body = await read_body(request)
        except ApiError as exc:
            status, out, hdr = front.rejected(route[0], exc)
        else:
            status, out, hdr = front.answer(route, kind, _hb(h.get("accept")), request.scope["query_string"], body, t0)
        return Response(out, status_code=status, media_type=hdr[1].decode())

    docs = openapi_docs()

    @app.post("/score", openapi_extra=docs["score"], responses=docs["responses"]["score"])
    async def score(request: Request) -> Response:
        return await served(request, front.routes["/score"])

    @app.post("/query", openapi_extra=docs["query"], responses=docs["responses"]["query"])
    async def query(request: Request) -> Response:
        return await served(request, front.routes["/query"])

    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = base_openapi()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(docs["components"])
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
    return BearerAuth(front, cfg.auth_token) if cfg.auth_token else front


def _hb(value: str | None) -> bytes | None:
    return None if value is None else value.encode("latin-1")


_REF = "#/components/schemas/{name}"
_QUERY_PARAMS = [
    {"name": n, "in": "query", "required": False, "schema": {"type": "string"},
     "description": f"{d} (application/octet-stream bodies only: JSON / msgpack bodies carry it as a field)"}
    for n, d in (("model", "model name"), ("model_name", "alias of model"), ("lora_name", "LoRA adapter name"),
                 ("cache_salt", "cache salt"))]


def openapi_docs() -> dict[str, Any]:
    """OpenAPI fragments for the front-served routes: request bodies in the three accepted
    encodings, the query parameters of the raw one, answers in JSON or msgpack (by Accept), errors."""
    (score_req, query_req, score_res, query_res, err), components = msgspec.json.schema_components(
        [ScoreRequest, QueryRequest, ScoreResponse, QueryResponse, ErrorResponse], ref_template=_REF)
    octet = {"schema": {"type": "string", "format": "binary"},
             "example": "little-endian u32 token ids, 4 bytes each, no header"}

    def body(ref: dict[str, Any], what: str) -> dict[str, Any]:
        return {"requestBody": {"required": True, "description": what, "content": {
            "application/json": {"schema": ref}, "application/msgpack": {"schema": ref}, "application/octet-stream": octet}},
            "parameters": _QUERY_PARAMS}

    def answers(ref: dict[str, Any]) -> dict[int | str, Any]:
        error = {"content": {"application/json": {"schema": err}}}
        return {200: {"description": "JSON, or msgpack when Accept names msgpack",
                      "content": {"application/json": {"schema": ref}, "application/msgpack": {"schema": ref}}},
                **{code: {"description": d, **error} for code, d in (
                    (400, "malformed body"), (401, "missing or invalid bearer token (with --auth-token)"),
                    (404, "unknown model"), (405, "not POST"), (413, "body over --max-body-mb"),
                    (415, "unsupported Content-Type"), (422, "invalid request (e.g. a token id above 2^32-1)"))}}

    return {"score": body(score_req, "the tokens of a prompt; the answer ranks every registered worker"),
            "query": body(query_req, "Dynamo / Mooncake-RFC query; the answer is matched tokens per worker"),
            "responses": {"score": answers(score_res), "query": answers(query_res)},
            "components": components}
