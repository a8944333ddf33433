"""Request bounds of the simulated worker's and the router's HTTP APIs: a body read with a size cap,
and the worker's per-request limits (FastAPI/Starlette requests; no torch, so the router can import it)."""
from __future__ import annotations

import asyncio

from starlette.requests import Request

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_OUTPUT_TOKENS = 32768  # per request: 2^20 would hold a batch slot for hours of simulated time
MAX_AHEAD_S = 3600.0  # how far past the worker's clock a request's virtual arrival may lie
# Idle keep-alive: the worker's server closes a connection idle this long (uvicorn's default, and
# vLLM's), and the routers' clients drop theirs sooner. Were they equal, a client could send a request
# on a pooled connection in the instant the server closes it: the forward fails with a connection
# reset (httpx ReadError) though the worker never saw the request.
WORKER_KEEPALIVE_S = 5.0
CLIENT_KEEPALIVE_S = 2.0


async def read_capped(request: Request, max_bytes: int) -> bytes | None:
    """The body, or None once it exceeds `max_bytes` (declared or streamed): answer 413."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


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
