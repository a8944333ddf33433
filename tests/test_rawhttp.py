"""router/proxy/rawhttp.py, the router's pooled HTTP/1.1 client, against a raw asyncio server that
frames its answers every legal way: the body read back is the body sent (Content-Length, chunked in
any split, to the close), a connection is reused only after a whole answer, a pooled connection the
server closed is replaced without losing the request, a refused connection is ConnectFailed, and an
answer cut short is an UpstreamError."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.proxy.rawhttp import ConnectFailed, RawClient, UpstreamError
from support.net import free_port


class Server:
    """Answers each request with the next planned (head, body pieces, close) exchange."""

    def __init__(self) -> None:
        self.plan: list[tuple[bytes, list[bytes], bool]] = []
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.plan:
                head = await r.readuntil(b"\r\n\r\n")
                n = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
                self.requests.append(head + await r.readexactly(n))
                status_head, pieces, close = self.plan.pop(0)
                w.write(status_head)
                for p in pieces:
                    w.write(p)
                    await w.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        w.close()

    def close(self) -> None:
        assert self.server is not None
        self.server.close()


def _chunked(body: bytes, cuts: list[int]) -> list[bytes]:
    """`body` as chunks cut at `cuts`, each chunk's framing itself split across writes."""
    out: list[bytes] = []
    prev = 0
    for c in sorted(set(x for x in cuts if 0 < x < len(body))) + [len(body)]:
        part = body[prev:c]
        if part:
            frame = f"{len(part):x}\r\n".encode() + part + b"\r\n"
            out += [frame[:2], frame[2:]]
        prev = c
    return out + [b"0\r\n", b"\r\n"]


@settings(max_examples=40, deadline=None)
@given(body=st.binary(max_size=3000), cuts=st.lists(st.integers(0, 3000), max_size=6),
       framing=st.sampled_from(["length", "chunked", "close"]))
def test_the_body_read_is_the_body_sent(body: bytes, cuts: list[int], framing: str) -> None:
    async def main() -> None:
        srv = Server()
        url = await srv.start()
        if framing == "length":
            head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-A: 1\r\n\r\n" % len(body)
            pieces, close = [body[:len(body) // 2], body[len(body) // 2:]], False
        elif framing == "chunked":
            head, pieces, close = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", _chunked(body, cuts), False
        else:
            head, pieces, close = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", [body], True
        srv.plan = [(head, pieces, close), (b"HTTP/1.1 204 No Content\r\n\r\n", [], False)]
        client = RawClient()
        try:
            resp = await client.request(url, "POST", "/x", [(b"content-type", b"application/json")], b"{}")
            assert resp.status_code == 200 and await resp.aread() == body
            await resp.aclose()
            status, rest = await client.call(url, "POST", "/y", body=b"[1]")
            assert (status, rest) == (204, b"")
            assert srv.connections == (2 if framing == "close" else 1)  # reused after a whole answer only
            assert srv.requests[-1].endswith(b"\r\n\r\n[1]")
        finally:
            client.close()
            srv.close()

    asyncio.run(main())


def test_a_pooled_connection_the_server_closed_is_replaced() -> None:
    async def main() -> None:
        srv = Server()
        url = await srv.start()
        srv.plan = [(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n", [b"a"], True),  # closes after answering
                    (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n", [b"b"], False)]
        client = RawClient()
        try:
            resp = await client.request(url, "GET", "/")
            await resp.aread()
            await resp.aclose()  # no Connection: close header: the client pools it, the server closed it
            await asyncio.sleep(0.05)  # the close reaches the client (a real idle gap)
            assert await client.call(url, "GET", "/") == (200, b"b")
            assert srv.connections == 2
        finally:
            client.close()
            srv.close()

    asyncio.run(main())


def test_refused_and_cut_answers_raise() -> None:
    async def main() -> None:
        client = RawClient()
        with pytest.raises(ConnectFailed):
            await client.request(f"http://127.0.0.1:{free_port()}", "GET", "/")
        srv = Server()
        url = await srv.start()
        srv.plan = [(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", [b"abc"], True)]
        try:
            resp = await client.request(url, "GET", "/")
            with pytest.raises(UpstreamError):
                await resp.aread()
            await resp.aclose()
            with pytest.raises(ValueError):
                client.pool("https://example.com")
        finally:
            client.close()
            srv.close()

    asyncio.run(main())
