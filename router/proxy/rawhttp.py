"""A pooled HTTP/1.1 client on asyncio streams: the router's calls to the indexer and its forwards
to the engines (plain `http://`). httpx costs about 1 ms of CPU per request on this machine, most
of the router's budget (docs/openai.md, "Cost per request"); this client writes the request in one
call, reads the head with one `readuntil`, and streams the body (Content-Length, chunked, or to the
close) without re-buffering.

Idle connections are kept per host up to `max_idle` for `keepalive_s` (engines close theirs after
5 s; the pool drops its own first). A request sent on a pooled connection that the server had
already closed (no byte of an answer: EOF or reset before the head) is sent again once on a new
connection — the server never saw it. Any other failure closes the connection and raises
`UpstreamError` (`ConnectFailed` when nothing was sent); a cancelled request closes its connection,
so the server sees the client leave.
"""
from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")

MAX_HEAD = 64 * 1024
READ_CHUNK = 64 * 1024
Header = tuple[str, str]


if sys.version_info >= (3, 11):
    async def within(aw: Awaitable[T], timeout_s: float) -> T:
        """`asyncio.wait_for` without its task per call (a deadline on the running task); raises
        asyncio.TimeoutError."""
        async with asyncio.timeout(timeout_s):
            return await aw
else:  # pragma: no cover - Python 3.10
    within = asyncio.wait_for


class UpstreamError(Exception):
    """The exchange failed (refused, reset, closed mid-answer, malformed answer)."""


class ConnectFailed(UpstreamError):
    """No connection could be made: the request was not sent."""


class _Conn:
    __slots__ = ("reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def close(self) -> None:
        try:
            self.writer.close()
        except (OSError, RuntimeError):
            pass


class RawResponse:
    """Status and headers read; the body streams from `aiter_raw()` (decoded from chunked framing).
    `aclose()` gives the connection back when the body was read whole, else closes it."""

    __slots__ = ("status_code", "headers", "_conn", "_pool", "_length", "_chunked", "_keep", "_done")

    def __init__(self, status: int, headers: list[Header], conn: _Conn, pool: HostPool) -> None:
        self.status_code = status
        self.headers = headers
        self._conn: _Conn | None = conn
        self._pool = pool
        self._length: int | None = None
        self._chunked = False
        self._keep = True
        self._done = False
        for k, v in headers:
            lk = k.lower()
            if lk == "content-length":
                self._length = int(v) if v.strip().isdigit() else None
            elif lk == "transfer-encoding" and "chunked" in v.lower():
                self._chunked = True
            elif lk == "connection" and "close" in v.lower():
                self._keep = False
        if self._chunked:
            self._length = None
        elif self._length is None:
            self._keep = False  # the body ends with the connection
        if status in (204, 304) or 100 <= status < 200:
            self._length, self._chunked = 0, False

    @property
    def length(self) -> int | None:
        """The body's length as declared (Content-Length), None when chunked or to the close."""
        return None if self._chunked else self._length

    def header(self, name: str, default: str | None = None) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), default)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        conn = self._conn
        assert conn is not None
        r = conn.reader
        try:
            if self._chunked:
                while True:
                    line = await r.readuntil(b"\r\n")
                    size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                    if size == 0:
                        while (await r.readuntil(b"\r\n")) != b"\r\n":  # trailers
                            pass
                        break
                    left = size
                    while left:
                        piece = await r.read(min(left, READ_CHUNK))
                        if not piece:
                            raise UpstreamError("connection closed mid-chunk")
                        left -= len(piece)
                        yield piece
                    if await r.readexactly(2) != b"\r\n":
                        raise UpstreamError("malformed chunk")
            elif self._length is not None:
                left = self._length
                while left:
                    piece = await r.read(min(left, READ_CHUNK))
                    if not piece:
                        raise UpstreamError(f"connection closed with {left} body bytes to come")
                    left -= len(piece)
                    yield piece
            else:
                while True:
                    piece = await r.read(READ_CHUNK)
                    if not piece:
                        break
                    yield piece
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError) as exc:
            raise UpstreamError(f"answer broke off: {type(exc).__name__}: {exc}") from None
        self._done = True

    async def aread(self) -> bytes:
        conn = self._conn
        if conn is not None and not self._chunked and self._length is not None and not self._done:
            try:  # a declared length: one read, no iterator
                data = await conn.reader.readexactly(self._length)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                raise UpstreamError(f"answer broke off: {type(exc).__name__}: {exc}") from None
            self._done = True
            return data
        return b"".join([c async for c in self.aiter_raw()])

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self._keep:
            self._pool.put(conn)
        else:
            conn.close()


class HostPool:
    def __init__(self, host: str, port: int, *, max_idle: int = 64, keepalive_s: float = 2.0,
                 connect_timeout_s: float = 2.0) -> None:
        self.host = host
        self.port = port
        self.max_idle = max_idle
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[_Conn] = []
        self._host_header = f"{host}:{port}".encode("latin-1")

    def put(self, conn: _Conn) -> None:
        if len(self._idle) >= self.max_idle or conn.reader.at_eof():
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def _take(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < self.keepalive_s and not conn.reader.at_eof():
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Conn:
        try:
            reader, writer = await within(asyncio.open_connection(self.host, self.port, limit=MAX_HEAD),
                                          self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            raise ConnectFailed(f"connect to {self.host}:{self.port}: {type(exc).__name__}: {exc}") from None
        return _Conn(reader, writer)

    def _head(self, method: str, path: str, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
        out = [f"{method} {path} HTTP/1.1\r\n".encode("latin-1"), b"host: ", self._host_header, b"\r\n"]
        for k, v in headers:
            out += [k, b": ", v, b"\r\n"]
        out += [b"content-length: ", str(len(body)).encode(), b"\r\n\r\n", body]
        return b"".join(out)

    async def request(self, method: str, path: str, headers: Sequence[tuple[bytes, bytes]] = (),
                      body: bytes = b"") -> RawResponse:
        """Send and read the answer's head; the body is the caller's to read (`RawResponse`)."""
        data = self._head(method, path, headers, body)
        for attempt in (0, 1):
            conn = self._take() if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            try:
                conn.writer.write(data)
                head = await conn.reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                conn.close()
                if reused and (not isinstance(exc, asyncio.IncompleteReadError) or not exc.partial):
                    continue  # the server had closed the idle connection: it never saw this request
                raise UpstreamError(f"no answer from {self.host}:{self.port}: {type(exc).__name__}") from None
            except asyncio.LimitOverrunError:
                conn.close()
                raise UpstreamError(f"answer head over {MAX_HEAD} bytes") from None
            except BaseException:  # cancelled (deadline, client gone): the server sees us leave
                conn.close()
                raise
            try:
                lines = head[:-4].decode("latin-1").split("\r\n")
                status = int(lines[0].split(" ", 2)[1])
                hdrs: list[Header] = []
                for ln in lines[1:]:
                    k, _, v = ln.partition(":")
                    hdrs.append((k.strip(), v.strip()))
            except (ValueError, IndexError):
                conn.close()
                raise UpstreamError(f"malformed answer head: {head[:80]!r}") from None
            return RawResponse(status, hdrs, conn, self)
        raise UpstreamError("unreachable")  # pragma: no cover - the loop returns or raises

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


class RawClient:
    """Host pools by base URL (`http://host:port`)."""

    def __init__(self, *, max_idle: int = 64, keepalive_s: float = 2.0, connect_timeout_s: float = 2.0) -> None:
        self._pools: dict[str, HostPool] = {}
        self._kw = {"max_idle": max_idle, "keepalive_s": keepalive_s, "connect_timeout_s": connect_timeout_s}

    def pool(self, base_url: str) -> HostPool:
        p = self._pools.get(base_url)
        if p is None:
            u = urlsplit(base_url)
            if u.scheme != "http" or not u.hostname:
                raise ValueError(f"{base_url!r}: the raw client speaks plain http://host:port")
            p = self._pools[base_url] = HostPool(u.hostname, u.port or 80, **self._kw)  # type: ignore[arg-type]
        return p

    async def request(self, base_url: str, method: str, path: str, headers: Sequence[tuple[bytes, bytes]] = (),
                      body: bytes = b"") -> RawResponse:
        return await self.pool(base_url).request(method, path, headers, body)

    async def call(self, base_url: str, method: str, path: str, headers: Sequence[tuple[bytes, bytes]] = (),
                   body: bytes = b"", timeout_s: float = 5.0) -> tuple[int, bytes]:
        """A whole exchange within `timeout_s`: (status, body)."""
        async def run() -> tuple[int, bytes]:
            resp = await self.request(base_url, method, path, headers, body)
            try:
                data = await resp.aread()
            finally:
                await resp.aclose()
            return resp.status_code, data

        try:
            return await within(run(), timeout_s)
        except asyncio.TimeoutError:
            raise UpstreamError(f"{base_url}{path}: no answer within {timeout_s:g}s") from None

    def close(self) -> None:
        for p in self._pools.values():
            p.close()
        self._pools.clear()
