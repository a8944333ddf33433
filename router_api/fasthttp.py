"""uvicorn's httptools protocol with `POST /score` and `POST /query` answered in the parser's own
callbacks, and `GET /health` with them (docs/service.md, "HTTP stack").

Measured on this host, uvicorn's per-request machinery (scope dict, RequestResponseCycle, an
asyncio Event and Task, the ASGI message dicts and their awaits) costs ~0.1 ms — as much as the
whole 1k-token score. For the two hot routes this protocol skips it: the body is collected in
`on_body`, and `on_message_complete` calls the ASGI front's `prepare` / `answer` (the one
validation / negotiation path) and writes the response in one `transport.write`. A large body's
answer comes from the front's answer pool (router_api/offload.py) and is written when it is ready; an
`_OffLoop` marker stands as uvicorn's cycle meanwhile, so a request pipelined behind it waits in
uvicorn's pipeline (and the connection's shutdown and disconnect handling see it). Everything else
— other routes, methods other than POST, pipelined requests behind a running one, `Expect:
100-continue`, upgrades, a root path, a request without a valid bearer token — takes uvicorn's
path unchanged (where the ASGI front and BearerAuth answer it). uvicorn keeps the server: sockets,
keep-alive timer, flow control, signals, graceful shutdown.

`GuardedHttpProtocol` (the base of the fast path, also used without it) bounds what a client can
hold: a request must arrive whole (headers and body) within `request_timeout_s` of its first byte,
or of the connection's start, else 408 and close (this deadline and uvicorn's keep-alive timeout are
watched by one lazily re-set timer per connection, not a timer per request); past `max_connections` open connections a new
one gets 503 and is closed at once (docs/limits.md). Both are counted in
`kvatlas_http_rejects_total{endpoint="http"}`.

It reads uvicorn's `HttpToolsProtocol` internals (`parser`, `url`, `headers`, `cycle`, `pipeline`,
`expect_100_continue`, `on_response_complete`, `flow`, `timeout_keep_alive`, `server_state`); `supported()`
checks them, and `cli.indexer.server_settings` falls back to plain httptools without them.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from router_api.app import BearerAuth, bearer_ok
from router_api.bodies import ApiError
from router_api.http_head import SimpleHead, fields, simple_get, simple_post
from router_api.score_front import Answer, Route, ScoreFront, body_headers

HEALTH = Route("health", type(None), lambda *a: b"")  # marks a GET /health in flight (never called)
_NEEDED = ("on_headers_complete", "on_body", "on_message_complete", "on_response_complete",
           "_unset_keepalive_if_required", "connection_made", "connection_lost", "on_message_begin",
           "timeout_keep_alive_handler")
DEFAULT_REQUEST_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 1024


def supported() -> bool:
    """True when this uvicorn's httptools protocol has the hooks the fast path overrides."""
    return all(hasattr(HttpToolsProtocol, n) for n in _NEEDED) and isinstance(STATUS_LINE, dict)


def find_front(app: Any) -> ScoreFront | None:
    """The ScoreFront of an app built by `create_app` (directly, or under BearerAuth)."""
    if isinstance(app, ScoreFront):
        return app
    return app.front if isinstance(app, BearerAuth) else None


def _plain(status: int, reason: bytes, message: bytes) -> bytes:
    body = b'{"error":"' + message + b'"}'
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, reason, len(body))) + body


_TIMED_OUT = _plain(408, b"Request Timeout", b"request not received in full in time")
_TOO_MANY = _plain(503, b"Service Unavailable", b"too many open connections")


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a request-read deadline and a connection cap (module doc).
    The limits are class attributes: `protocol_class` makes a subclass per server."""

    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    on_reject: Any = None  # counts a rejection by reason (servers without a ScoreFront: `kvatlas worker`)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The two deadlines of a connection (loop times, None: not running) and the one timer that
        # watches both (`_watch`). Arming or clearing a deadline is a store: a timer created and
        # cancelled per request (uvicorn's keep-alive timer, and the request deadline with it) cost
        # ~5 us of every ~40 us keep-alive request here (two uvloop call_later + cancel pairs).
        self._request_until: float | None = None  # the request in progress must be whole by then
        self._idle_until: float | None = None  # keep-alive: closed unless a byte arrives by then
        self._watch: Any = None
        self._watch_at = 0.0

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._count("connection_limit")
            transport.write(_TOO_MANY)
            transport.close()
            return
        self._arm()  # the first request, too, must arrive within the deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._request_until = self._idle_until = None
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        self._arm()
        super().on_message_begin()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _arm(self) -> None:
        self._idle_until = None  # a request has begun: its deadline governs, not keep-alive's
        if self._request_until is None:
            self._request_until = self.loop.time() + self.request_timeout_s
            self._watch_until(self._request_until)

    def _disarm(self) -> None:
        self._request_until = None

    # -- keep-alive: uvicorn's timer replaced by the idle deadline --------------------------
    def _unset_keepalive_if_required(self) -> None:
        self._idle_until = None
        super()._unset_keepalive_if_required()  # (none is ever set: on_response_complete below)

    def on_response_complete(self) -> None:
        if self.pipeline or self.transport.is_closing():
            super().on_response_complete()  # pipelined requests start as uvicorn starts them
            return
        self.server_state.total_requests += 1
        self.flow.resume_reading()
        if self._request_until is None:  # else the next request has begun: its deadline governs
            self._idle_until = self.loop.time() + self.timeout_keep_alive
            self._watch_until(self._idle_until)

    def _watch_until(self, when: float) -> None:
        """The watch fires by `when`. A running one that fires earlier is kept: when it fires it
        looks at the deadlines as they are then and sets itself for the next."""
        if self._watch is not None:
            if self._watch_at <= when:
                return
            self._watch.cancel()
        self._watch_at = when
        self._watch = self.loop.call_at(when, self._on_watch)

    def _on_watch(self) -> None:
        self._watch = None
        now = self.loop.time()
        if self._request_until is not None and now >= self._request_until:
            self._expired()
        elif self._idle_until is not None and now >= self._idle_until:
            self._idle_until = None
            self.timeout_keep_alive_handler()
        else:
            nxt = [t for t in (self._request_until, self._idle_until) if t is not None]
            if nxt:
                self._watch_until(min(nxt))

    def _expired(self) -> None:
        self._request_until = None
        if self.transport.is_closing():
            return
        self._count("request_timeout")
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:  # no answer begun
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the app, still reading the body, answers nobody
            self.transport.write(_TIMED_OUT)
        self.transport.close()

    def _count(self, reason: str) -> None:
        if self.on_reject is not None:
            self.on_reject(reason)
            return
        front = find_front(self.app)
        if front is not None:
            front.metrics.http_rejects.inc("http", reason)


def protocol_class(fast_path: bool, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                   max_connections: int = DEFAULT_MAX_CONNECTIONS, on_reject: Any = None) -> type:
    """The uvicorn `http` protocol class for one server, with its limits (`on_reject(reason)`: where
    rejections are counted when the app has no ScoreFront)."""
    base = ScoreHttpProtocol if fast_path else GuardedHttpProtocol
    return type(base.__name__, (base,), protocol_limits(request_timeout_s, max_connections, on_reject))


def protocol_limits(request_timeout_s: float, max_connections: int, on_reject: Any = None) -> dict[str, Any]:
    """The class attributes of a GuardedHttpProtocol subclass with these limits (checked)."""
    if request_timeout_s <= 0 or max_connections < 1:
        raise ValueError("request_timeout_s must be > 0 and max_connections >= 1")
    return {"request_timeout_s": float(request_timeout_s), "max_connections": int(max_connections),
            "on_reject": staticmethod(on_reject) if on_reject is not None else None}


class _Pending:
    """A fast-path request between its headers and its last body byte."""

    __slots__ = ("route", "kind", "accept", "query", "t0", "chunks", "size", "error", "keep_alive", "done")

    def __init__(self, route: Route, kind: str, accept: bytes | None, query: bytes, t0: float,
                 keep_alive: bool) -> None:
        self.route = route
        self.kind = kind
        self.accept = accept
        self.query = query
        self.t0 = t0
        self.chunks: list[bytes] = []
        self.size = 0
        self.error: ApiError | None = None
        self.keep_alive = keep_alive
        self.done = False  # answered early (413) and closing: the rest of the request is ignored


class _Event:
    """What uvicorn sets on a cycle's message event at disconnect: nobody waits on this one."""

    __slots__ = ()

    def set(self) -> None:
        pass


_NO_WAITER = _Event()


class _OffLoop:
    """uvicorn's cycle while an answer is computed off the loop (the attributes uvicorn and
    GuardedHttpProtocol read or set on `self.cycle`)."""

    __slots__ = ("response_complete", "response_started", "disconnected", "keep_alive", "message_event")

    def __init__(self, keep_alive: bool) -> None:
        self.response_complete = False
        self.response_started = False
        self.disconnected = False
        self.keep_alive = keep_alive  # uvicorn's shutdown clears it: the answer then closes the connection
        self.message_event = _NO_WAITER


class ScoreHttpProtocol(GuardedHttpProtocol):
    """See the module docstring. Without a ScoreFront in the app it is plain HttpToolsProtocol."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._front = find_front(self.app) if not self.root_path else None
        self._pending: _Pending | None = None
        self._head_key: object = None
        self._head = b""
        self._between = True  # the parser is between messages (no request of it under way)

    # -- one read, one whole request -----------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        # A router's keep-alive query arrives whole in one read: a plain POST is answered from these
        # bytes (router_api/http_head.py) without the parser's eight callbacks. Whatever the strict
        # subset leaves out, and any read that is not exactly one request, takes the parser's path.
        front = self._front
        if front is not None and self._between and not self.pipeline \
                and (self.cycle is None or self.cycle.response_complete):
            if data.startswith(b"POST /"):
                head = simple_post(data)
                if head is not None:
                    route = front.raw_routes.get(head.target)
                    if route is not None and self._whole(front, route, head, data):
                        return
            elif data.startswith(b"GET /health HTTP/1.1\r\n"):  # the load balancers' probe (no auth)
                head = simple_get(data)
                if head is not None and head.target == b"/health" and head.end == len(data):
                    self._idle_until = self._request_until = None
                    self._reply(front.health(), close=not head.keep_alive)
                    return
        super().data_received(data)

    def _whole(self, front: ScoreFront, route: Route, head: SimpleHead, data: bytes) -> bool:
        """Answer the request `head` begins when `data` is exactly that request; False (nothing done)
        when the parser's path must judge it: a body not whole or followed by more bytes, an oversize
        or unauthorised request."""
        clen, keep_alive, end = head.content_length, head.keep_alive, head.end
        size = int(clen) if clen is not None else 0
        if size > front.max_body or len(data) - end != size:
            return False
        if front.token is not None and not bearer_ok(fields(head.block), front.token):
            return False  # uvicorn's path: BearerAuth answers 401
        t0 = time.perf_counter()
        # the request is whole: neither its read deadline nor keep-alive's governs until the answer is out
        self._idle_until = self._request_until = None
        try:
            kind = front.prepare(head.content_type, clen)
        except ApiError as exc:  # (never 413: the size was checked above)
            self._reply(front.rejected(route.endpoint, exc), close=not keep_alive)
            return True
        # a raw u32 body is viewed in the read's bytes (octet_tokens); a copy of it was ~5 µs at 8k tokens
        got = front.dispatch(route, kind, head.accept, b"", memoryview(data)[end:] if kind == "octet" else data[end:], t0)
        if isinstance(got, Future):
            self._later(got, keep_alive)
        else:
            self._reply(got, close=not keep_alive)
        return True

    # -- parser callbacks --------------------------------------------------------------------
    def on_message_begin(self) -> None:
        # uvicorn builds the ASGI scope dict here; the fast path never reads it, so it is built only
        # when uvicorn takes the request (`_to_uvicorn`)
        self._between = False
        if self._front is None:
            super().on_message_begin()
            return
        self._arm()
        self.url = b""
        self.expect_100_continue = False
        self.headers = []

    def _to_uvicorn(self) -> None:
        """uvicorn's own on_headers_complete, with the scope on_message_begin would have built."""
        if self._front is not None:
            url, headers, expect = self.url, self.headers, self.expect_100_continue
            HttpToolsProtocol.on_message_begin(self)  # the scope, around a fresh headers list: refilled in place
            self.url, self.expect_100_continue = url, expect
            self.headers.extend(headers)
        super().on_headers_complete()

    def on_headers_complete(self) -> None:
        front = self._front
        if front is not None and not self.expect_100_continue and not self.pipeline \
                and (self.cycle is None or self.cycle.response_complete) and not self.parser.should_upgrade():
            method = self.parser.get_method()
            if method == b"POST":
                route = front.raw_routes.get(self.url)  # the common spelling: the path alone
                if route is not None:
                    query = b""
                else:
                    url = httptools.parse_url(self.url)
                    route = front.routes.get(url.path.decode("latin-1"))
                    query = url.query or b""
                if route is not None and (front.token is None or bearer_ok(self.headers, front.token)):
                    self._start(front, route, query)
                    return
            elif method == b"GET" and self.url == b"/health":  # the load balancers' probe; no auth (as BearerAuth)
                self._pending = _Pending(HEALTH, "", None, b"", 0.0, self._keep_alive())
                return
        self._to_uvicorn()

    def _keep_alive(self) -> bool:
        return self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()

    def _start(self, front: ScoreFront, route: Route, query: bytes) -> None:
        t0 = time.perf_counter()
        ctype, accept, clen = body_headers(self.headers)
        p = self._pending = _Pending(route, "", accept, query, t0, self._keep_alive())
        try:
            p.kind = front.prepare(ctype, clen)
        except ApiError as exc:
            if exc.status == 413:  # refuse a declared oversize body without reading it
                self._reply(front.rejected(route.endpoint, exc), close=True)
                return
            p.error = exc  # answered once the (discarded) body has been read

    def on_body(self, body: bytes) -> None:
        p = self._pending
        if p is None:
            super().on_body(body)
            return
        if p.done or p.error is not None:
            return
        p.size += len(body)
        front = self._front
        assert front is not None
        if p.size > front.max_body:
            exc = ApiError(413, f"body exceeds the {front.max_body}-byte limit", "too_large")
            self._reply(front.rejected(p.route.endpoint, exc), close=True)
            return
        p.chunks.append(body)

    def on_message_complete(self) -> None:
        self._between = True
        p = self._pending
        if p is None:
            super().on_message_complete()
            return
        self._disarm()
        self._pending = None
        if p.done:
            return
        front = self._front
        assert front is not None
        if p.route is HEALTH:
            ans = front.health()
        elif p.error is not None:
            ans = front.rejected(p.route.endpoint, p.error)
        else:
            body = p.chunks[0] if len(p.chunks) == 1 else b"".join(p.chunks)
            got = front.dispatch(p.route, p.kind, p.accept, p.query, body, p.t0)
            if isinstance(got, Future):
                self._later(got, p.keep_alive)
                return
            ans = got
        self._reply(ans, close=not p.keep_alive)

    def _later(self, fut: Future, keep_alive: bool) -> None:
        """Write the off-loop answer `fut` on the loop once it is ready (see `_OffLoop`)."""
        mark = self.cycle = _OffLoop(keep_alive)  # type: ignore[assignment]
        loop = self.loop

        def ready(f: Future) -> None:  # on the pool's thread
            try:
                loop.call_soon_threadsafe(self._answered, mark, f)
            except RuntimeError:  # the loop is closed: the server is gone, nobody to answer
                pass
        fut.add_done_callback(ready)

    def _answered(self, mark: _OffLoop, fut: Future) -> None:
        mark.response_complete = True
        if mark.disconnected or self.transport.is_closing():
            return
        try:
            ans = fut.result()
        except BaseException as exc:  # `answer` never raises; a cancelled future (pool shut down) does
            front = self._front
            assert front is not None
            ans = front.rejected("http", ApiError(503, f"not answered: {type(exc).__name__}", "offload_cancelled"))
        self._reply(ans, close=not mark.keep_alive)

    # -- response ----------------------------------------------------------------------------
    def _reply(self, ans: Answer, close: bool) -> None:
        status, body, ctype = ans
        defaults = self.server_state.default_headers  # a new list each second (the date)
        if defaults is not self._head_key:
            self._head_key = defaults
            self._head = b"".join(n + b": " + v + b"\r\n" for n, v in defaults)
        self.transport.write(b"".join((
            STATUS_LINE[status], self._head, ctype[0], b": ", ctype[1], b"\r\ncontent-length: ",
            str(len(body)).encode(), b"\r\nconnection: close\r\n\r\n" if close else b"\r\n\r\n", body)))
        if close:
            if self._pending is not None:
                self._pending.done = True
            self.transport.close()
            self._unset_keepalive_if_required()
            return
        self.on_response_complete()  # request count, resume reading, keep-alive timer
