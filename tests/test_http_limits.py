"""The indexer's HTTP port bounds what clients can hold (issue 24): a request that does not arrive
whole within the request timeout is answered 408 and closed (slowloris: partial headers or a
partial body), a connection past the cap is answered 503 and closed, and an aborted body is a
counted client disconnect, not an internal error with a traceback. An idle kept-alive connection is
closed after the keep-alive timeout, and a connection that served requests still gets the request
deadline for its next one (one timer per connection watches both)."""
from __future__ import annotations

import logging
import socket
import threading

import httpx
import pytest

from router_api.app import create_app
from cli.indexer import server_settings
from router_api.config import ServiceConfig
from router_api.service import IndexerService
from support.net import free_port, read_until_closed, wait_until


class Server:
    """One service behind a real uvicorn with the indexer's own protocol settings."""

    def __init__(self, fast: bool, request_timeout_s: float, max_connections: int,
                 keep_alive_s: float | None = None) -> None:
        import uvicorn

        self.service = IndexerService(ServiceConfig(block_size=4))
        self.service.start()
        self.port = free_port()
        settings = server_settings("127.0.0.1", self.port, fast, request_timeout_s, max_connections)
        settings["loop"] = "asyncio"  # a test thread, not the main one
        if keep_alive_s is not None:
            settings["timeout_keep_alive"] = keep_alive_s
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.service), **settings))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, timeout=10)
        self.url = f"http://127.0.0.1:{self.port}"

    def rejects(self, reason: str) -> float:
        return self.service.metrics.http_rejects.get("http", reason)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.service.stop(final_snapshot=False)


def _open(port: int, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    if data:
        s.sendall(data)
    return s


PARTIAL = [
    b"",  # connected, nothing sent
    b"POST /score HTTP/1.1\r\nHost: x\r\n",  # headers never end
    b"POST /workers HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"w",
    b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"t",
    b"GET /health HTTP/1.1\r\nHost: x\r\n",
]


@pytest.mark.parametrize("fast", [True, False], ids=["fast_path", "asgi_path"])
def test_slow_partial_requests_are_closed_with_408(fast: bool) -> None:
    srv = Server(fast, request_timeout_s=1.0, max_connections=1000)
    try:
        socks = [_open(srv.port, PARTIAL[i % len(PARTIAL)]) for i in range(40)]
        answers = [read_until_closed(s) for s in socks]  # each returns once the server closed it
        for s in socks:
            s.close()
        assert all(a == b"" or a.startswith(b"HTTP/1.1 408") for a in answers), {a[:40] for a in answers}
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers), {a[:40] for a in answers}
        assert srv.rejects("request_timeout") == 40
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        # A complete request on a kept-alive connection is not cut by the deadline.
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            assert c.get("/health").status_code == 200
            assert c.post("/score", json={"token_ids": [1, 2, 3, 4]}).status_code == 200
    finally:
        srv.close()


@pytest.mark.parametrize("fast", [True, False], ids=["fast_path", "asgi_path"])
def test_connections_past_the_cap_get_503_and_are_closed(fast: bool) -> None:
    srv = Server(fast, request_timeout_s=600.0, max_connections=20)
    held = [_open(srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n") for _ in range(20)]
    try:
        wait_until(lambda: len(srv.server.server_state.connections) == 20, timeout=10)
        extra = _open(srv.port, b"")  # (a request sent meanwhile, never read, may turn the close into a reset)
        assert read_until_closed(extra).startswith(b"HTTP/1.1 503")
        extra.close()
        assert srv.rejects("connection_limit") == 1
        held.pop().close()
        wait_until(lambda: len(srv.server.server_state.connections) < 20, timeout=10)
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    finally:
        for s in held:
            s.close()
        srv.close()


def test_an_aborted_body_is_a_counted_disconnect_not_an_internal_error(caplog: pytest.LogCaptureFixture) -> None:
    srv = Server(True, request_timeout_s=600.0, max_connections=1000)
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(30):
                s = _open(srv.port, b"POST /workers HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                    b"Content-Length: 1000\r\n\r\n{\"worker_id\": \"w")
                s.close()
            wait_until(lambda: srv.service.metrics.http_rejects.get("register", "client_disconnect") == 30,
                       timeout=20, interval=0.05)
        assert srv.service.metrics.http_rejects.get("/workers", "internal_error") == 0
        assert not [r for r in caplog.records if "internal_error" in r.getMessage() or r.exc_info], \
            [r.getMessage() for r in caplog.records]
    finally:
        srv.close()


SCORE = (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 22\r\n\r\n"
         b'{"token_ids":[1,2,3,4]}'[:22])
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize("fast", [True, False], ids=["fast_path", "asgi_path"])
def test_idle_keep_alive_connections_are_closed_and_served_ones_keep_the_deadline(fast: bool) -> None:
    # keep-alive timeout below the request deadline: an idle connection is closed (no answer
    # pending, so no 408); one that goes on to send half a request after its answers gets 408.
    srv = Server(fast, request_timeout_s=2.0, max_connections=1000, keep_alive_s=0.5)
    try:
        idle = [_open(srv.port, HEALTH) for _ in range(5)]
        for s in idle:
            s.settimeout(30)
        answers = [read_until_closed(s) for s in idle]  # returns once the server closed the idle connection
        assert all(a.startswith(b"HTTP/1.1 200") and a.count(b"HTTP/1.1") == 1 for a in answers), answers
        assert srv.rejects("request_timeout") == 0
        # two whole requests and half of a third, in one write: the half one is in progress once the
        # answers are out, so the request deadline governs it, not the (shorter) keep-alive timeout
        half = [_open(srv.port, HEALTH + HEALTH + SCORE[:30]) for _ in range(5)]
        for s in half:
            got = read_until_closed(s)
            assert got.count(b"HTTP/1.1 200") == 2 and got.count(b"HTTP/1.1 408") == 1, got
        assert srv.rejects("request_timeout") == 5
        for s in idle + half:
            s.close()
    finally:
        srv.close()


def test_a_request_whole_in_one_read_leaves_the_connection_to_the_keep_alive_timeout() -> None:
    # The one-read path (router_api/http_head.py) answers without the parser's callbacks: the
    # connection's first-request deadline must still be lifted, so the idle connection is closed by
    # the (shorter) keep-alive timeout with its one answer, never answered 408 by the request deadline.
    srv = Server(True, request_timeout_s=2.0, max_connections=1000, keep_alive_s=0.5)
    body = b'{"token_ids":[1,2,3,4]}'
    one = (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
           % len(body)) + body
    try:
        conns = [_open(srv.port, one) for _ in range(5)]
        for s in conns:
            got = read_until_closed(s)
            assert got.startswith(b"HTTP/1.1 200") and got.count(b"HTTP/1.1") == 1, got
            s.close()
        assert srv.rejects("request_timeout") == 0
    finally:
        srv.close()
