"""Idle keep-alive between the router and the servers it forwards to (sim.httpbody): no forward
goes out on a connection its server is closing for idleness (a connection reset: httpx ReadError from
BrokenResourceError, the server never saw the request). The OpenAI proxy, facing engines that close
after 5 s, drops its own idle connections first, and a `kvatlas worker` keeps them longer than that.
Real uvicorn with the worker's settings and the proxy's real client. The pause is the subject (a
connection idle longer than a client keeps it), not a synchronisation."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from sim.api import SimModel
from sim.cmd import server_config
from sim.httpbody import CLIENT_KEEPALIVE_S, WORKER_KEEPALIVE_S
from router.proxy.core import ProxyCore
from support.net import free_port, wait_until

ENGINE_KEEPALIVE_S = 5.0  # vLLM's and uvicorn's default: what the proxy's engines do
PAUSE_S = CLIENT_KEEPALIVE_S + 0.5


async def _peer(request: Request) -> JSONResponse:
    client = request.client
    return JSONResponse({"port": None if client is None else client.port})


@pytest.fixture(scope="module")
def worker_server() -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(server_config(Starlette(routes=[Route("/peer", _peer)]), "127.0.0.1", port))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    wait_until(lambda: server.started, timeout=30)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(10)


async def _ports(client: httpx.AsyncClient, url: str) -> tuple[int, int, int]:
    """The client's port of a request, of one right after it, and of one after a pause."""
    a = (await client.get(f"{url}/peer")).json()["port"]
    b = (await client.get(f"{url}/peer")).json()["port"]
    await asyncio.sleep(PAUSE_S)
    c = (await client.get(f"{url}/peer")).json()["port"]
    return a, b, c


def test_keep_alive_settings_are_ordered() -> None:
    assert 0 < CLIENT_KEEPALIVE_S < PAUSE_S < ENGINE_KEEPALIVE_S < WORKER_KEEPALIVE_S


def test_the_proxy_drops_idle_connections_before_an_engine_closes_them(worker_server: str) -> None:
    sim = SimModel()

    async def main() -> tuple[int, int, int]:
        proxy = ProxyCore({"w": worker_server}, indexer=None, model="m", tokenizer=None, policy="round_robin", sim=sim)
        try:
            return await _ports(proxy.client, worker_server)
        finally:
            await proxy.close()

    a, b, c = asyncio.run(main())
    assert a == b  # pooled while busy
    assert c != a  # a fresh connection after the pause: the client dropped the idle one
