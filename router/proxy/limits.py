"""The OpenAI proxy's bounds: request body size, idle keep-alive toward the engines, deadlines."""
from __future__ import annotations

MAX_BODY_BYTES = 8 * 1024 * 1024
# vLLM and uvicorn close idle connections after 5 s: the proxy drops its own pooled ones first, so it
# never sends on a connection in the instant the engine closes it.
CLIENT_KEEPALIVE_S = 2.0
