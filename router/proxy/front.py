"""The router's hot routes served from the HTTP protocol itself (docs/openai.md, "Cost per request"):
`POST /v1/chat/completions` and `POST /v1/completions` are read in the httptools parser's callbacks
and answered by one task per request that routes, forwards and writes the engine's answer to the
transport chunk for chunk (SSE passes through as it arrives; a body the engine sized keeps its
Content-Length, any other goes out chunked). Everything else — other routes and methods, a query
string, a root path, `Expect: 100-continue`, upgrades, a request pipelined behind a running one —
takes uvicorn's path to the ASGI app (router/proxy/app.py), which serves the same routes by the
same code (router/proxy/exchange.py).

uvicorn's per-request ASGI machinery and FastAPI's routing and middleware stack cost about as much
CPU as the whole routed exchange (tokenize, `/routes/decide`, forward, relay); this path skips them.
The base is the indexer's guarded protocol (router_api/fasthttp.py): the request-read deadline, the
connection cap and keep-alive's idle deadline hold here unchanged. While a request is answered, an
`_OffLoop` marker (fasthttp.py's) stands as uvicorn's cycle, so a pipelined request waits in
uvicorn's pipeline and uvicorn's shutdown closes the connection after the answer.

A client that leaves (the connection is lost) cancels the request's task: before the answer began,
the upstream request is closed (the engine stops) and `client_gone` counted; during it, the relay
closes upstream and releases the route. An engine answer that breaks off cuts the client's
connection without a clean end (no final chunk, or fewer bytes than declared).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from router.proxy.core import ProxyCore, Truncated
from router.proxy.exchange import ROUTED, Opened, Refused, open_routed, parse, refused, too_large
from router.proxy.limits import MAX_BODY_BYTES
from router_api.fasthttp import (DEFAULT_MAX_CONNECTIONS, DEFAULT_REQUEST_TIMEOUT_S, GuardedHttpProtocol, _OffLoop,
                                 protocol_limits)

log = logging.getLogger("kvatlas.router")
_PATHS = {p.encode(): (p, chat) for p, chat in ROUTED.items()}


# A refused request's body still on its way is read and dropped for this long and this much at most
# (a lingering close), so the client reads its 413 rather than a connection reset.
LINGER_S = 2.0
LINGER_BYTES = 16 * 1024 * 1024

class _Request:
    """A hot-route request between its headers and its last body byte."""

    __slots__ = ("path", "chat", "keep_alive", "headers", "chunks", "size", "done")

    def __init__(self, path: str, chat: bool, keep_alive: bool, headers: list[tuple[bytes, bytes]]) -> None:
        self.path = path
        self.chat = chat
        self.keep_alive = keep_alive
        self.headers = headers
        self.chunks: list[bytes] = []
        self.size = 0
        self.done = False  # answered early (413) and closing: the rest is ignored


class ProxyHttpProtocol(GuardedHttpProtocol):
    """See the module docstring. `core` and `max_body` are class attributes (`proxy_protocol_class`)."""

    core: ProxyCore
    max_body: int = MAX_BODY_BYTES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._req: _Request | None = None
        self._task: asyncio.Task[None] | None = None
        self._started = False  # the answer's head is written (the client is past the point of a refusal)
        self._head_key: object = None
        self._defaults = b""

    # -- reading -----------------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        hot = _PATHS.get(self.url)
        if hot is not None and not self.root_path and not self.expect_100_continue and not self.pipeline \
                and (self.cycle is None or self.cycle.response_complete) and not self.parser.should_upgrade() \
                and self.parser.get_method() == b"POST":
            core = self.core
            core.counts["requests"] += 1
            keep = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
            req = self._req = _Request(hot[0], hot[1], keep, self.headers)
            declared = next((v for k, v in self.headers if k == b"content-length"), None)
            if declared is not None and declared.isdigit() and int(declared) > self.max_body:
                self._refuse(req, too_large(self.max_body))  # without reading the body
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        req = self._req
        if req is None:
            super().on_body(body)
            return
        req.size += len(body)
        if req.done:  # refused: what the client still sends is dropped, within the linger's bound
            if req.size > self.max_body + LINGER_BYTES:
                self.transport.close()
            return
        if req.size > self.max_body:
            self._refuse(req, too_large(self.max_body))
            return
        req.chunks.append(body)

    def on_message_complete(self) -> None:
        req = self._req
        if req is None:
            super().on_message_complete()
            return
        self._disarm()
        self._req = None
        if req.done:  # the refused body has all arrived: the 413 is read by now or never will be
            self.transport.close()
            return
        raw = req.chunks[0] if len(req.chunks) == 1 else b"".join(req.chunks)
        mark = self.cycle = _OffLoop(req.keep_alive)  # type: ignore[assignment]
        self._started = False
        task = self._task = self.loop.create_task(self._answer(req, raw, mark))
        self.tasks.add(task)  # uvicorn's shutdown waits for it
        task.add_done_callback(self.tasks.discard)

    def connection_lost(self, exc: Exception | None) -> None:
        task = self._task
        if task is not None and not task.done():
            if not self._started:  # left before the answer began: the upstream request is cancelled
                self.core.counts["client_gone"] += 1
            task.cancel()
        super().connection_lost(exc)

    # -- answering ---------------------------------------------------------------------------
    async def _answer(self, req: _Request, raw: bytes, mark: _OffLoop) -> None:
        core = self.core
        try:
            body = parse(core, raw)
            got = body if isinstance(body, Refused) else await open_routed(core, req.path, raw, body, req.headers,
                                                                             req.chat)
            if isinstance(got, Refused):
                self._write_whole(got, mark)
            else:
                await self._relay(got, mark)
        except asyncio.CancelledError:  # the client left, or uvicorn's shutdown gave up waiting
            if self._started:
                self.transport.close()  # mid-answer: cut, as an engine that breaks off
            elif not self.transport.is_closing():
                self._write_whole(refused(503, "the router is shutting down", "ServiceUnavailable"), mark)
        except Exception:  # a fault of the router's own: logged, the client told (500) or cut
            log.exception("event=proxy_error path=%s", req.path)
            if self._started:
                self.transport.close()
            else:
                self._write_whole(Refused(500, b'{"error": {"message": "internal error", "code": 500}}'), mark)
        finally:
            self._task = None

    async def _relay(self, got: Opened, mark: _OffLoop) -> None:
        chunked = got.length is None
        head = self._head(got.status, got.headers, got.length, mark.keep_alive)
        mark.response_started = self._started = True
        write, flow = self.transport.write, self.flow
        try:
            async for chunk in got.chunks:
                if not chunk:
                    continue
                data = b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk
                if head:
                    data, head = head + data, b""
                write(data)
                if flow.write_paused:
                    await flow.drain()
        except Truncated:
            if head:
                write(head)
            self.transport.close()  # no clean end: the client can tell
            mark.response_complete = True
            return
        write(head + b"0\r\n\r\n" if chunked else head)
        self._finish(mark)

    def _write_whole(self, r: Refused, mark: _OffLoop) -> None:
        if self.transport.is_closing():
            mark.response_complete = True
            return
        mark.response_started = self._started = True
        self.transport.write(self._head(r.status, {"content-type": "application/json"}, len(r.body), mark.keep_alive)
                             + r.body)
        self._finish(mark)

    def _finish(self, mark: _OffLoop) -> None:
        mark.response_complete = True
        if not mark.keep_alive or mark.disconnected:
            self.transport.close()
            return
        self.on_response_complete()  # request count, resume reading, pipelined requests, keep-alive deadline

    def _refuse(self, req: _Request, r: Refused) -> None:
        """Answer before the body is read (413), then close once the client stopped sending. Closing at
        once would reset a connection the client is still writing to, and a reset can reach the client
        before the answer does: so the rest of the body is read and dropped (a lingering close), for
        LINGER_S and LINGER_BYTES past the cap at most."""
        req.done = True
        self._disarm()
        self.transport.write(self._head(r.status, {"content-type": "application/json"}, len(r.body), False) + r.body)
        self.loop.call_later(LINGER_S, self.transport.close)

    def _head(self, status: int, headers: dict[str, str], length: int | None, keep_alive: bool) -> bytes:
        defaults = self.server_state.default_headers  # a new list each second (the date)
        if defaults is not self._head_key:
            self._head_key = defaults
            self._defaults = b"".join(n + b": " + v + b"\r\n" for n, v in defaults)
        lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")
        framing = b"transfer-encoding: chunked\r\n" if length is None else b"content-length: %d\r\n" % length
        return b"".join((STATUS_LINE.get(status) or b"HTTP/1.1 %d \r\n" % status, self._defaults, lines, framing,
                         b"\r\n" if keep_alive else b"connection: close\r\n\r\n"))


def proxy_protocol_class(core: ProxyCore, max_body_bytes: int = MAX_BODY_BYTES,
                         request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                         max_connections: int = DEFAULT_MAX_CONNECTIONS) -> type:
    """The uvicorn `http` protocol class of one router server: its core and limits."""
    return type(ProxyHttpProtocol.__name__, (ProxyHttpProtocol,),
                {**protocol_limits(request_timeout_s, max_connections, core.http_rejected), "core": core, "max_body": int(max_body_bytes)})
