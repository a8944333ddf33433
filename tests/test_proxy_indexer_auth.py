"""The OpenAI router's calls to an indexer run with auth (issue 37, finding 2, on the one decision
path): the decision, the admission report and the release riding on it, and the release batch all
carry the bearer token; without it every call is refused, counted, and the router's /health state
names the fix."""
from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from router.proxy.indexer import IndexerClient, Unavailable
from router_api.config import ServiceConfig
from router_api.decide import Candidate, DecideRequest
from support.net import free_port
from support.service import LiveIndexer


def test_indexer_calls_carry_the_token_and_refusals_are_counted() -> None:
    with LiveIndexer(ServiceConfig(port=free_port(), block_size=4, auth_token="sekret")) as idx:
        r = idx.client.post("/workers", json={"worker_id": "s0", "endpoint": f"tcp://127.0.0.1:{free_port()}",
                                              "model": "default", "block_size": 4})
        assert r.status_code == 201, r.text
        tokens = np.arange(1, 33, dtype=np.uint32).tobytes()

        def req(rid: str) -> DecideRequest:
            return DecideRequest(rid, [Candidate("s0")], "default", tokens=tokens, choice="s0", admits=True)

        async def with_token() -> dict[str, int]:
            async with httpx.AsyncClient() as http:
                c = IndexerClient(idx.url, http, "sekret", release_every_s=3600.0)
                assert (await c.decide(req("t-1"))).reserved
                c.admitted("default", "t-1")
                c.release("default", "t-1")
                assert (await c.decide(req("t-2"))).reserved  # t-1's admission and release ride on it
                c.admitted("default", "t-2")
                c.release("default", "t-2")
                await c.flush()  # the batch
                await c.close()
                assert c.state == "ok"
                return c.counts

        counts = asyncio.run(with_token())
        assert (counts["decided"], counts["admitted"], counts["released"]) == (2, 2, 2)
        pending = idx.service.routes.pending.counts
        assert (pending.added, pending.released) == (2, 2)
        assert idx.service.routes.admission.admitted == 2

        async def without() -> IndexerClient:
            async with httpx.AsyncClient() as http:
                c = IndexerClient(idx.url, http, None, release_every_s=3600.0)
                with pytest.raises(Unavailable):
                    await c.decide(req("n-1"))
                c.admitted("default", "n-0")
                c.release("default", "n-0")
                await c.flush()
                await c.close()
                return c

        c = asyncio.run(without())
        assert c.counts["unauthorized"] == 1 and c.state.startswith("refusing: HTTP 401")
        assert "--indexer-token-file" in c.state
        assert (c.counts["release_failed"], c.counts["admit_failed"]) == (1, 1)
        assert idx.service.routes.pending.counts.added == 2  # nothing got in
