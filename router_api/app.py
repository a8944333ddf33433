"""HTTP app around an IndexerService. `create_app(service)` — no globals.

The hot endpoints (`POST /score`, `POST /query`) are served by a pure ASGI front ahead of FastAPI
(`ScoreFront`, router_api/score_front.py) that decodes bodies itself (router_api/bodies.py: cached
msgspec decoders, the C token-array parser, raw little-endian u32 bodies) and answers with the bytes the
service writes. Everything else goes through FastAPI, built here, with the bearer check around both.
Every error is JSON `{"error": msg}`; bodies above the limit get 413 before any parsing; bad
input is counted per endpoint and reason.
"""
from __future__ import annotations

import asyncio
import hmac
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from router_api.metrics import CONTENT_TYPE_LATEST
from router_api.bodies import ApiError, check_length, content_kind, decode_body
from router_api.http_log import RateLimitedLog, escape_log
from router_api.registry import RegistryError
from router_api.decide import Chooser, Decider
from router_api.decide_http import add_decide_routes, add_structured_post, decide_route
from router_api.routes import UnknownRouteWorker, WaitsFull
from router_api.offload import AnswerPool
from router_api.score_front import ASGIApp, Route, ScoreFront
from router_api.service import IndexerService, UnknownModel
from schemas.api import (
    ErrorResponse,
    QueryRequest,
    QueryResponse,
    RegisterWorker,
    RouteAdmitted,
    RouteRelease,
    RouteReport,
    RouteWait,
    RouteWaitAnswer,
    ScoreRequest,
    ScoreResponse,
)

STATIC_DIR = Path(__file__).resolve().parent / "static"
_json = msgspec.json.Encoder()
_msgpack = msgspec.msgpack.Encoder()

T = TypeVar("T")


def _settle(fut: asyncio.Future[None]) -> None:
    """Resolve a waiter's future once, on the loop (a second wake finds it done)."""
    if not fut.done():
        fut.set_result(None)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(ErrorResponse(error=message)), status_code=status,
                    media_type="application/json", headers=headers)


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
        self.fastapi = app.fastapi if isinstance(app, ScoreFront) else app
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


async def _client_gone(request: Request) -> None:
    """Returns when the client of a request whose body was read hangs up."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(service: IndexerService, native_bodies: bool | None = None, pool: AnswerPool | None = None,
               chooser: Chooser | None = None) -> ASGIApp:
    """The service's ASGI app: bearer check (when configured) -> ScoreFront -> FastAPI.
    The FastAPI app itself is reachable as `.fastapi` on the result. `native_bodies` picks the
    /score body decoder like `indexer.core.native.select` (None: native when built); `pool` answers
    large /score and /query bodies off the event loop (None: the defaults of router_api/offload.py);
    `chooser` picks workers for `POST /routes/decide` (router_api/decide.py; None: routers choose)."""
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
        try:
            async for chunk in request.stream():
                total += len(chunk)
                if total > max_body:
                    raise ApiError(413, f"body exceeds the {max_body}-byte limit", "too_large")
                chunks.append(chunk)
        except ClientDisconnect:  # the client went away mid-body: its loss, counted, no traceback
            raise ApiError(499, "client disconnected before the body was read", "client_disconnect") from None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def encode_for(request: Request, obj: Any, status: int = 200) -> Response:
        accept = request.headers.get("accept", "")
        if "msgpack" in accept:
            return Response(_msgpack.encode(obj), status_code=status, media_type="application/msgpack")
        return Response(_json.encode(obj), status_code=status, media_type="application/json")

    async def structured_body(request: Request, typ: type[T], refusal: str) -> T:
        """The request's JSON or msgpack body as `typ`; a raw u32 body is refused with 415 (`refusal`)."""
        kind = content_kind(request.headers.get("content-type", "application/json"))
        if kind == "octet":
            raise ApiError(415, refusal, "bad_content_type")
        return decode_body(kind, await read_body(request), typ)

    def observe(endpoint: str, t0: float) -> None:
        metrics.request_latency.observe(time.perf_counter() - t0, endpoint)

    @app.post("/workers")
    async def register(request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            reg = await structured_body(request, RegisterWorker, "register with a JSON or msgpack body")
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
            r = await structured_body(request, RouteReport, "report a route with a JSON or msgpack body")
            answer = service.report_route(r.model, r.request_id, r.worker_id, r.token_ids, r.dp_rank,
                                          r.lora_name, r.cache_salt, r.busy_until, r.admits)
        except ApiError as exc:
            return reject("routes", exc)
        except (UnknownModel, UnknownRouteWorker) as exc:
            return reject("routes", ApiError(404, str(exc).strip("'\""), "unknown_worker"))
        observe("routes", t0)
        return encode_for(request, answer)

    decider = Decider(service, chooser, UnknownModel, UnknownRouteWorker)
    add_decide_routes(app, decider, structured_body, encode_for, reject, observe)

    add_structured_post(app, "/routes/admitted", "routes_admitted", RouteAdmitted,
                        "report an admission with a JSON or msgpack body",
                        lambda a: {"admitted": service.admit_route(a.model, a.request_id)}, structured_body,
                        encode_for, reject, doc="The worker accepted a routed request into its queue: routes "
                        "waiting for it may go (routers send it on their next decision or release batch).")

    @app.post("/routes/wait")
    async def route_wait(request: Request) -> Response:
        """Answers once one of the named routes no longer awaits admission, or at the timeout (a long
        poll on this loop: no thread is held while it waits)."""
        try:
            w = await structured_body(request, RouteWait, "wait with a JSON or msgpack body")
        except ApiError as exc:
            return reject("routes_wait", exc)
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def wake() -> None:  # under the service lock, maybe on another thread (a replica's admission)
            loop.call_soon_threadsafe(_settle, woken)

        try:
            token = service.watch_routes(w.model, w.request_ids, wake)
        except WaitsFull as exc:
            return reject("routes_wait", ApiError(503, str(exc), "waits_full"))
        try:
            if token is not None:
                # A client that hangs up ends its wait (the waiter set only holds live ones).
                gone = asyncio.ensure_future(_client_gone(request))
                try:
                    await asyncio.wait((woken, gone), timeout=w.timeout_s, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    gone.cancel()
        finally:
            left = service.end_wait(w.model, w.request_ids, token, time.monotonic() - t0)
        return encode_for(request, RouteWaitAnswer(left, time.monotonic() - t0))

    @app.delete("/routes/{request_id:path}")
    async def release_route(request: Request, request_id: str, model: str = "default") -> Response:
        return encode_for(request, RouteRelease(service.release_route(model, request_id)))

    @app.get("/workers")
    async def workers(request: Request) -> Response:
        return encode_for(request, service.workers())

    @app.get("/workers/{worker_id:path}")
    async def worker(request: Request, worker_id: str) -> Response:
        """One registered worker's row (404 when the indexer does not know it)."""
        try:
            return encode_for(request, service.worker(worker_id))
        except RegistryError as exc:
            return _error(exc.status, str(exc))

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
        # the route's template, not the raw path: a label per URL sent would grow without end
        route = getattr(request.scope.get("route"), "path", None) or "unrouted"
        if isinstance(exc, ClientDisconnect):  # not ours: nobody is left to answer
            metrics.http_rejects.inc(route, "client_disconnect")
            return _error(499, "client disconnected")
        metrics.http_rejects.inc(route, "internal_error")
        # one traceback per route and error type per interval: a repeated failure cannot flood the log
        limiter.error(f"internal:{route}:{type(exc).__name__}", "event=internal_error path=%s",
                      escape_log(request.url.path), exc_info=exc)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    front: Any = ScoreFront(app, service, native_bodies, limiter, pool)
    front.add_route("/routes/decide", decide_route(decider))

    async def served(request: Request, route: Route) -> Response:
        """/score and /query through FastAPI: the front's own path (reached when the app is mounted
        without the front, e.g. `create_app(...).fastapi`); the routes also document the two in OpenAPI."""
        t0 = time.perf_counter()
        h = request.headers
        try:
            kind = front.prepare(_hb(h.get("content-type")), _hb(h.get("content-length")))
            body = await read_body(request)
        except ApiError as exc:
            status, out, hdr = front.rejected(route.endpoint, exc)
        else:
            status, out, hdr = await front.respond(route, kind, _hb(h.get("accept")), request.scope["query_string"],
                                                   body, t0)
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
