"""What a router reads of a `kvatlas worker` before routing to it: its health (the simulated model
and the block size), waiting for it to come up."""
from __future__ import annotations

import asyncio
import logging
import time

import httpx
import msgspec

from sim.api import WorkerHealth

log = logging.getLogger("kvatlas.router")
_health_dec = msgspec.json.Decoder(WorkerHealth)


async def fetch_sim(client: httpx.AsyncClient, url: str, deadline_s: float = 60.0) -> WorkerHealth:
    """A worker's health (its simulated model and block size), waiting for it to come up. A server
    that answers but is not a `kvatlas worker` (vLLM's empty /health body, a 404) is a ValueError
    at once, naming the fix; an unreachable one is retried (logged) until the deadline."""
    end = time.monotonic() + deadline_s
    logged = False
    while True:
        try:
            r = await client.get(f"{url.rstrip('/')}/health", timeout=5.0)
        except httpx.HTTPError as exc:
            if not logged:
                log.warning("event=waiting_for_worker url=%s error=%s", url, exc)
                logged = True
        else:
            if r.status_code == 200:
                try:
                    return _health_dec.decode(r.content)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    pass
            raise ValueError(f"worker {url} answered /health with HTTP {r.status_code} {r.content[:80]!r}, "
                             "not as a kvatlas worker: for vLLM / SGLang engines run the router with --api openai "
                             "and no --trace")
        if time.monotonic() > end:
            raise TimeoutError(f"worker {url} did not become healthy")
        await asyncio.sleep(0.1)  # readiness poll
