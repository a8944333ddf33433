"""Request bounds of the simulated worker's and the router's HTTP APIs: a body read with a size cap,
and the worker's per-request limits (FastAPI/Starlette requests; no torch, so the router can import it)."""
from __future__ import annotations

from starlette.requests import Request

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_OUTPUT_TOKENS = 32768  # per request: 2^20 would hold a batch slot for hours of simulated time
MAX_AHEAD_S = 3600.0  # how far past the worker's clock a request's virtual arrival may lie


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
