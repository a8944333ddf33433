"""The score front: a pure ASGI app serving `POST /score` and `POST /query` ahead of FastAPI (`ScoreFront`).
It reads the raw body, decodes it (router_api/bodies.py) and answers with the bytes the service writes
(`/score`: in C, router_api/answer.py) — no routing, dependency solving or Request/Response objects per
query. `prepare` + `answer` are also what the uvicorn protocol fast path (router_api/fasthttp.py) and the
FastAPI routes that document the two endpoints call (docs/service.md, "HTTP stack")."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from typing import Any, Awaitable, Callable, Iterable, NamedTuple, cast
from urllib.parse import parse_qsl

import msgspec

from router_api import score_text
from router_api.bodies import ApiError, TokenBodies, check_length, content_kind, decode_body, octet_tokens
from router_api.http_log import RateLimitedLog
from router_api.offload import AnswerPool
from router_api.score_plan import answer_limit
from router_api.service import IndexerService, UnknownModel
from schemas.api import ErrorResponse, QueryRequest, ScoreRequest

_json = msgspec.json.Encoder()
_msgpack = msgspec.msgpack.Encoder()


ASGIApp = Callable[..., Awaitable[None]]  # (scope, receive, send)
_JSON_HEADERS = (b"content-type", b"application/json")
_MSGPACK_HEADERS = (b"content-type", b"application/msgpack")


class Route(NamedTuple):
    """One endpoint the front serves: its metrics label, request type and
    handler(model, tokens, lora_name, cache_salt, msgpack) -> answer bytes; or, `structured`, a
    JSON or msgpack body decoded whole as `request_type` and handler(request, msgpack) -> answer
    bytes (raising ApiError), answered on the loop (`/routes/decide`: router_api/decide_http.py)."""

    endpoint: str
    request_type: type
    handler: Callable[..., bytes]
    structured: bool = False


class BodyHeaders(NamedTuple):
    """The request headers that negotiate a /score or /query body (the last of a repeated one counts)."""

    content_type: bytes | None
    accept: bytes | None
    content_length: bytes | None


def body_headers(headers: Iterable[tuple[bytes, bytes]]) -> BodyHeaders:
    ctype = accept = clen = None
    for k, v in headers:
        if k == b"content-type":
            ctype = v
        elif k == b"accept":
            accept = v
        elif k == b"content-length":
            clen = v
    return BodyHeaders(ctype, accept, clen)


class Answer(NamedTuple):
    status: int
    body: bytes
    content_type: tuple[bytes, bytes]  # the header (name, value)


class _ClientGone(Exception):
    """The client disconnected before sending its whole body: nothing to answer."""


_OFF_LOOP = Answer(0, b"", _JSON_HEADERS)  # `answer`'s "not here": a text request, answered on the pool


class ScoreFront:
    """Pure ASGI front serving `/score` and `/query` without the framework; every other request
    goes to `app` (FastAPI). `prepare` + `answer` are the one validation / negotiation path of the
    two endpoints: this front, the uvicorn protocol fast path (`router_api.fasthttp`) and the
    FastAPI routes that document them in OpenAPI all call them (docs/service.md, "HTTP stack")."""

    __slots__ = ("app", "service", "metrics", "max_body", "default_model", "routes", "fastapi", "bodies",
                 "limiter", "token", "_kinds", "raw_routes", "pool")

    def __init__(self, app: ASGIApp, service: IndexerService, native: bool | None = None,
                 limiter: RateLimitedLog | None = None, pool: AnswerPool | None = None) -> None:
        self.app = app
        self.pool = pool if pool is not None else AnswerPool()  # large bodies' answers, off the loop
        gauge = service.metrics.offload_pending
        gauge.set(value=float(self.pool.pending))
        self.pool.on_pending = lambda n: gauge.set(value=float(n))
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
            "/score": Route("score", ScoreRequest, service.score_answer),  # answer bytes written in C when it can
            "/query": Route("query", QueryRequest, _encoded(service.query_compat))}
        # the same routes by their raw request-target: the protocol fast path looks that up before parsing it
        self.raw_routes: dict[bytes, Route] = {path.encode(): r for path, r in self.routes.items()}

    def add_route(self, path: str, route: Route) -> None:
        """Serve `route` at `path` too (here, and on the protocol fast path)."""
        self.routes[path] = route
        self.raw_routes[path.encode()] = route

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
        ctype, accept, clen = body_headers(scope["headers"])
        try:
            kind = self.prepare(ctype, clen)
            body = await self._read(receive)
        except _ClientGone:
            return
        except ApiError as exc:
            await _send(send, *self.rejected(route.endpoint, exc))
            return
        await _send(send, *await self.respond(route, kind, accept, scope["query_string"], body, t0))

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
        return Answer(200, _json.encode(self.service.health()), _JSON_HEADERS)

    def rejected(self, endpoint: str, exc: ApiError) -> Answer:
        self.metrics.http_rejects.inc(endpoint, exc.reason)
        if exc.loud:
            self.limiter.warning(exc.reason, "event=rejected endpoint=%s reason=%s status=%d",
                                 endpoint, exc.reason, exc.status)
        return Answer(exc.status, _json.encode(ErrorResponse(error=exc.message)), _JSON_HEADERS)

    def dispatch(self, route: Route, kind: str, accept: bytes | None, query_string: bytes, body: bytes | memoryview,
                 t0: float) -> Answer | Future:
        """`answer` on the caller's thread for a small body; for a large one (router_api/offload.py) a
        Future of it from the answer pool, or 503 at once when the pool is full. The one place that
        decides: this front (`respond`), the FastAPI routes and the protocol fast path all call it."""
        pool = self.pool
        if route.structured:  # its handler keeps the service's state: on the loop, as its FastAPI route did
            return self.answer(route, kind, accept, query_string, body, t0, True)
        if not pool.wants(len(body)):
            ans = self.answer(route, kind, accept, query_string, body, t0, True)
            if ans is not _OFF_LOOP:
                return ans
        fut = pool.submit(self.answer, route, kind, accept, query_string, body, t0)
        if fut is None:
            return self.rejected(route.endpoint, ApiError(
                503, f"busy: {pool.max_pending} large request bodies are already being answered; retry",
                "offload_full"))
        return fut

    async def respond(self, route: Route, kind: str, accept: bytes | None, query_string: bytes, body: bytes,
                      t0: float) -> Answer:
        """`dispatch`, awaited."""
        ans = self.dispatch(route, kind, accept, query_string, body, t0)
        return await asyncio.wrap_future(ans) if isinstance(ans, Future) else ans

    def answer(self, route: Route, kind: str, accept: bytes | None, query_string: bytes, body: bytes | memoryview,
               t0: float, on_loop: bool = False) -> Answer:
        """(status, body, content-type header) for a whole request body; never raises. `on_loop`: a
        text request (tokenizing: CPU bound whatever its size) answers `_OFF_LOOP`, to be sent to the pool."""
        endpoint, typ, handler = route.endpoint, route.request_type, route.handler
        mp = accept is not None and b"msgpack" in accept
        try:
            if route.structured:
                if kind == "octet":
                    raise ApiError(415, f"{endpoint}: send a JSON or msgpack body", "bad_content_type")
                out = handler(decode_body(kind, cast(bytes, body), typ), mp)
            elif kind == "octet" and not query_string:  # the common raw request: the default model, no salt
                out = handler(self.default_model, octet_tokens(body), None, None, mp)
            elif kind == "octet":
                qp = dict(parse_qsl(query_string.decode("latin-1"), keep_blank_values=True))
                model = qp.get("model") or qp.get("model_name") or self.default_model
                args = (model, octet_tokens(body), qp.get("lora_name") or None, qp.get("cache_salt") or None, mp)
                lim = query_limit(qp) if typ is ScoreRequest else None
                out = handler(*args) if lim is None else handler(*args, lim)
            else:
                req, tokens = self.bodies.decode(kind, cast(bytes, body), typ)  # a view only for "octet"
                if typ is QueryRequest:
                    model = req.model_name or req.model or self.default_model
                    out = handler(model, tokens, req.lora_name, req.cache_salt, mp)
                elif score_text.is_text(tokens, req.prompt, req.messages):  # prompt / messages: tokenized here
                    if on_loop:
                        return _OFF_LOOP
                    out = score_text.text_answer(self.service, req.model, req, mp, self.pool.text_slots)
                elif req.answer is None and req.top_k is None:
                    out = handler(req.model, tokens, req.lora_name, req.cache_salt, mp)
                else:
                    out = handler(req.model, tokens, req.lora_name, req.cache_salt, mp, body_limit(req.answer, req.top_k))
        except ApiError as exc:
            return self.rejected(endpoint, exc)
        except score_text.TextInputError as exc:
            return self.rejected(endpoint, ApiError(exc.status, exc.message, exc.reason))
        except UnknownModel as exc:
            self.metrics.http_rejects.inc(endpoint, "unknown_model")
            return Answer(404, _json.encode(ErrorResponse(error=str(exc))), _JSON_HEADERS)
        except Exception as exc:  # a bug must answer 500 and be counted, never kill the connection
            path = "/" + endpoint
            self.metrics.http_rejects.inc(path, "internal_error")
            self.limiter.error(f"internal:{path}:{type(exc).__name__}", "event=internal_error path=%s", path,
                               exc_info=exc)
            return Answer(500, _json.encode(ErrorResponse(error=f"internal error: {type(exc).__name__}: {exc}")),
                          _JSON_HEADERS)
        dt = time.perf_counter() - t0
        self.metrics.request_latency.observe(dt, endpoint)
        if endpoint == "score":
            self.metrics.recent_score.add(dt)
        return Answer(200, out, _MSGPACK_HEADERS if mp else _JSON_HEADERS)

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


def body_limit(answer: str | None, top_k: int | None) -> int | None:
    """A /score request's answer form as the service takes it (score_plan.answer_limit; None: the
    default); 422 for top_k with answer=full."""
    if answer is None and top_k is None:
        return None
    try:
        return answer_limit(answer, top_k, 0)
    except ValueError as exc:
        raise ApiError(422, str(exc), "bad_answer_form") from None


def query_limit(qp: dict[str, str]) -> int | None:
    """`answer` / `top_k` of a raw /score's query string (`?answer=holders&top_k=8`)."""
    answer, top_k = qp.get("answer") or None, qp.get("top_k") or None
    if answer is not None and answer not in ("full", "holders"):
        raise ApiError(422, "answer: 'full' or 'holders'", "bad_answer_form")
    k = None
    if top_k is not None:
        if not top_k.isdigit() or not 1 <= int(top_k) <= 1 << 24:
            raise ApiError(422, "top_k: an int in [1, 2^24]", "bad_answer_form")
        k = int(top_k)
    return body_limit(answer, k)


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
