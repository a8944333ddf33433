"""Idle keep-alive between routers and workers (producer.sim.httpbody): a router's client drops an
idle pooled connection before the worker's server closes it, so no forward is ever sent on a
connection the server is closing (a connection reset, httpx ReadError, with the worker never having
seen the request: what equal 5 s timeouts on both sides produced under load). Real uvicorn with the
worker's settings, the router's and the OpenAI proxy's real clients. Each test idles a connection for
longer than the client keeps it and shorter than the server does (the subject, not a synchronisation)."""
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

from producer.sim.api import SimModel
from producer.sim.cmd import server_config
from producer.sim.httpbody import CLIENT_KEEPALIVE_S, WORKER_KEEPALIVE_S
from router_api.proxy.core import ProxyCore
from router_api.router.forwarder import RouterCore
from router_api.router.policies import make_policy
from support.net import free_port, wait_until

IDLE_S = CLIENT_KEEPALIVE_S + 0.5


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
    """The client's port of a request, of one right after it, and of one after an idle pause."""
    a = (await client.get(f"{url}/peer")).json()["port"]
    b = (await client.get(f"{url}/peer")).json()["port"]
    await asyncio.sleep(IDLE_S)
    c = (await client.get(f"{url}/peer")).json()["port"]
    return a, b, c


def test_the_client_keep_alive_is_shorter_than_the_workers() -> None:
    assert 0 < CLIENT_KEEPALIVE_S and IDLE_S < WORKER_KEEPALIVE_S


def test_the_worker_keeps_an_idle_connection_longer_than_a_router_does(worker_server: str) -> None:
    async def main() -> tuple[int, int, int]:
        async with httpx.AsyncClient(limits=httpx.Limits(keepalive_expiry=60.0)) as c:
            return await _ports(c, worker_server)

    a, b, c = asyncio.run(main())
    assert a == b == c  # the server still held the connection after IDLE_S


def test_routers_drop_idle_connections_before_the_worker_closes_them(worker_server: str) -> None:
    sim = SimModel()

    async def main() -> list[tuple[int, int, int]]:
        core = RouterCore(make_policy("round_robin", ["w"], sim), {"w": worker_server}, None, "m", 16, sim)
        proxy = ProxyCore({"w": worker_server}, indexer=None, model="m", tokenizer=None, policy="round_robin", sim=sim)
        try:
            return [await _ports(core.client, worker_server), await _ports(proxy.client, worker_server)]
        finally:
            await core.close()
            await proxy.close()

    for a, b, c in asyncio.run(main()):
        assert a == b  # pooled while busy
        assert c != a  # a fresh connection after IDLE_S: the pooled one was dropped by the client
