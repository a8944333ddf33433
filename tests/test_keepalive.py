"""Idle keep-alive between routers and the servers they forward to (sim.httpbody): no forward
goes out on a connection its server is closing for idleness (a connection reset: httpx ReadError from
BrokenResourceError, the server never saw the request). A `kvatlas router` keeps its idle connections
(its client never expires them: httpcore can close an expiring connection it has just handed to a
request, ReadError from ClosedResourceError) and the worker's server keeps them longer than any pause
in a router's traffic; the OpenAI proxy, facing engines that close after 5 s, drops its own first.
Real uvicorn with the worker's settings and the router's and the proxy's real clients. The pauses are
the subject (a connection idle longer than a client keeps it), not a synchronisation."""
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
from router_api.proxy.core import ProxyCore
from router_api.router.forwarder import RouterCore, describe
from router_api.router.policies import make_policy
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
    sim = SimModel()

    async def expiry() -> object:
        core = RouterCore(make_policy("round_robin", ["w"], sim), {"w": "http://127.0.0.1:1"}, None, "m", 16, sim)
        try:
            return core.client._transport._pool._keepalive_expiry  # type: ignore[attr-defined]
        finally:
            await core.close()

    assert asyncio.run(expiry()) is None  # the router's pool never closes a connection for idleness


def test_a_router_reuses_its_connection_to_a_worker_after_a_pause(worker_server: str) -> None:
    sim = SimModel()

    async def main() -> tuple[int, int, int]:
        core = RouterCore(make_policy("round_robin", ["w"], sim), {"w": worker_server}, None, "m", 16, sim)
        try:
            return await _ports(core.client, worker_server)
        finally:
            await core.close()

    a, b, c = asyncio.run(main())
    assert a == b == c  # neither side closed it


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


def test_a_forward_error_names_its_chain() -> None:
    class ClosedResourceError(Exception):
        pass

    try:
        try:
            raise ClosedResourceError
        except ClosedResourceError as inner:
            raise httpx.ReadError("") from inner
    except httpx.ReadError as exc:
        assert describe(exc) == "ReadError <- ClosedResourceError"
