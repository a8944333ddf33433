"""uvicorn's httptools protocol with `POST /score` and `POST /query` answered in the parser's own
callbacks, and `GET /health` with them (docs/service.md, "HTTP stack").

Measured on this host, uvicorn's per-request machinery (scope dict, RequestResponseCycle, an
asyncio Event and Task, the ASGI message dicts and their awaits) costs ~0.1 ms — as much as the
whole 1k-token score. For the two hot routes this protocol skips it: the body is collected in
`on_body`, and `on_message_complete` calls the ASGI front's `prepare` / `answer` (the one
validation / negotiation path) and writes the response in one `transport.write`. Everything else
— other routes, methods other than POST, pipelined requests behind a running one, `Expect:
100-continue`, upgrades, a root path, a request without a valid bearer token — takes uvicorn's
path unchanged (where the ASGI front and BearerAuth answer it). uvicorn keeps the server: sockets,
keep-alive timer, flow control, signals, graceful shutdown.

It reads uvicorn's `HttpToolsProtocol` internals (`parser`, `url`, `headers`, `cycle`, `pipeline`,
`expect_100_continue`, `on_response_complete`, `server_state.default_headers`); `supported()`
checks them, and `router_api.cmd_indexer.server_settings` falls back to plain httptools without them.
"""
from __future__ import annotations

import time
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from router_api.app import ApiError, Answer, Route, ScoreFront, bearer_ok

HEALTH: Route = ("health", type(None), lambda *a: None)  # marks a GET /health in flight
_NEEDED = ("on_headers_complete", "on_body", "on_message_complete", "on_response_complete",
           "_unset_keepalive_if_required")


def supported() -> bool:
    """True when this uvicorn's httptools protocol has the hooks the fast path overrides."""
    return all(hasattr(HttpToolsProtocol, n) for n in _NEEDED) and isinstance(STATUS_LINE, dict)


def find_front(app: Any) -> ScoreFront | None:
    """The ScoreFront of an app built by `create_app` (directly, or under BearerAuth)."""
    if isinstance(app, ScoreFront):
        return app
    front = getattr(app, "front", None)
    return front if isinstance(front, ScoreFront) else None


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


class ScoreHttpProtocol(HttpToolsProtocol):
    """See the module docstring. Without a ScoreFront in the app it is plain HttpToolsProtocol."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._front = find_front(self.app) if not self.root_path else None
        self._pending: _Pending | None = None
        self._head_key: object = None
        self._head = b""

    # -- parser callbacks --------------------------------------------------------------------
    def on_message_begin(self) -> None:
        # uvicorn builds the ASGI scope dict here; the fast path never reads it, so it is built only
        # when uvicorn takes the request (`_to_uvicorn`)
        if self._front is None:
            super().on_message_begin()
            return
        self.url = b""
        self.expect_100_continue = False
        self.headers = []

    def _to_uvicorn(self) -> None:
        """uvicorn's own on_headers_complete, with the scope on_message_begin would have built."""
        if self._front is not None:
            url, headers, expect = self.url, self.headers, self.expect_100_continue
            super().on_message_begin()  # the scope, around a fresh headers list: refilled in place
            self.url, self.expect_100_continue = url, expect
            self.headers.extend(headers)
        super().on_headers_complete()

    def on_headers_complete(self) -> None:
        front = self._front
        if front is not None and not self.expect_100_continue and not self.pipeline \
                and (self.cycle is None or self.cycle.response_complete) and not self.parser.should_upgrade():
            method = self.parser.get_method()
            if method == b"POST":
                url = httptools.parse_url(self.url)
                route = front.routes.get(url.path.decode("latin-1"))
                if route is not None and (front.token is None or bearer_ok(self.headers, front.token)):
                    self._start(front, route, url.query or b"")
                    return
            elif method == b"GET" and self.url == b"/health":  # the load balancers' probe; no auth (as BearerAuth)
                self._pending = _Pending(HEALTH, "", None, b"", 0.0, self._keep_alive())
                return
        self._to_uvicorn()

    def _keep_alive(self) -> bool:
        return self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()

    def _start(self, front: ScoreFront, route: Route, query: bytes) -> None:
        t0 = time.perf_counter()
        ctype = accept = clen = None
        for k, v in self.headers:
            if k == b"content-type":
                ctype = v
            elif k == b"accept":
                accept = v
            elif k == b"content-length":
                clen = v
        p = self._pending = _Pending(route, "", accept, query, t0, self._keep_alive())
        try:
            p.kind = front.prepare(ctype, clen)
        except ApiError as exc:
            if exc.status == 413:  # refuse a declared oversize body without reading it
                self._reply(front.rejected(route[0], exc), close=True)
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
            self._reply(front.rejected(p.route[0], exc), close=True)
            return
        p.chunks.append(body)

    def on_message_complete(self) -> None:
        p = self._pending
        if p is None:
            super().on_message_complete()
            return
        self._pending = None
        if p.done:
            return
        front = self._front
        assert front is not None
        if p.route is HEALTH:
            ans = front.health()
        elif p.error is not None:
            ans = front.rejected(p.route[0], p.error)
        else:
            body = p.chunks[0] if len(p.chunks) == 1 else b"".join(p.chunks)
            ans = front.answer(p.route, p.kind, p.accept, p.query, body, p.t0)
        self._reply(ans, close=not p.keep_alive)

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
