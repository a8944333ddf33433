"""`kvatlas worker`'s HTTP server bounds what a client can hold (issue 37, finding 14): a request's
headers and body must arrive within the deadline (else 408 and closed), and past the connection cap a
new connection gets 503 and is closed; both counted for the worker's /metrics."""
from __future__ import annotations

import socket
import threading

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from sim.app import HttpLimits
from sim.cmd import server_config
from support.net import free_port, read_until_closed, wait_until


async def _ok(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


def test_slow_headers_time_out_and_connections_are_capped() -> None:
    limits = HttpLimits(request_timeout_s=0.5, max_connections=8)
    port = free_port()
    server = uvicorn.Server(server_config(Starlette(routes=[Route("/ok", _ok)]), "127.0.0.1", port, limits))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    socks: list[socket.socket] = []
    try:
        wait_until(lambda: server.started, timeout=30)
        for _ in range(8):  # slowloris: a header line, never finished
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        wait_until(lambda: len(server.server_state.connections) == 8, timeout=20)
        extra = socket.create_connection(("127.0.0.1", port), timeout=30)
        assert b" 503 " in read_until_closed(extra).split(b"\r\n", 1)[0]  # over the cap: refused at once
        extra.close()
        for s in socks:  # each held connection ends at its deadline with 408
            assert b" 408 " in read_until_closed(s).split(b"\r\n", 1)[0]
        assert limits.rejects == {"connection_limit": 1, "request_timeout": 8}
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:  # honest clients are served again
            s.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert read_until_closed(s).endswith(b"ok")
    finally:
        for s in socks:
            s.close()
        server.should_exit = True
        t.join(30)
