"""A request body read with a size cap, for the Starlette apps (the OpenAI proxy's ASGI routes, the
simulated worker's APIs): the declared length is checked before anything is read, the streamed length
as it arrives."""
from __future__ import annotations

from starlette.requests import Request


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
