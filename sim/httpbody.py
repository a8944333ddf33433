"""Request bounds of the simulated worker's and the trace router's HTTP APIs: the worker's per-request
limits and keep-alive, and a wait for a client's disconnect (the capped body read is
router_api.request_body's). No torch, so the router can import it."""
from __future__ import annotations

import asyncio

from starlette.requests import Request


MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_OUTPUT_TOKENS = 32768  # per request: 2^20 would hold a batch slot for hours of simulated time
MAX_AHEAD_S = 3600.0  # how far past the worker's clock a request's virtual arrival may lie
# Idle keep-alive. A client must not send on a pooled connection in the instant the server closes it
# for idleness (a connection reset, httpx ReadError from BrokenResourceError, the server never saw the
# request): so the worker's server keeps idle connections WORKER_KEEPALIVE_S, longer than any pause
# of a router's traffic, and a `kvatlas router`'s client never expires them itself (httpcore 1.0.9 can
# close an expiring connection its pool has just handed to a request: ReadError from
# ClosedResourceError, seen in the loaded demo; encode/httpcore#1110). The OpenAI proxy's engines
# close idle connections after 5 s (vLLM's and uvicorn's default): it drops its own after
# CLIENT_KEEPALIVE_S, before they do.
WORKER_KEEPALIVE_S = 75.0
CLIENT_KEEPALIVE_S = 2.0


async def client_left_within(request: Request, seconds: float) -> bool:
    """Wait up to `seconds`; True as soon as the client disconnects. Call it once the body is read:
    the next ASGI message is then the disconnect (other readers of `receive` see it too)."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    if seconds <= 0:
        return False
    try:
        await asyncio.wait_for(gone(), seconds)
        return True
    except asyncio.TimeoutError:
        return False
