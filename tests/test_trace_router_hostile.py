"""The trace router (`kvatlas router --api sim`) under issue 37's findings 1 and 2: a hostile or stale
`busy_until` is not kept for good (the rows' value replaces the kept one, bounded ahead of now), its
own reports stay within the indexer's bound; its route calls carry the indexer's token, and a
refusal is counted."""
from __future__ import annotations

import asyncio

import numpy as np

from router.forwarder import MAX_AHEAD_S, RouterCore
from router.policies import ScoreRow, make_policy
from router_api.config import ServiceConfig
from schemas.costmodel import SimModel
from support.net import free_port
from support.service import LiveIndexer

SIM = SimModel()


def _core(indexer: str | None = None) -> RouterCore:
    return RouterCore(make_policy("precise_tiered", ["s0", "s1"], SIM), {"s0": "http://x", "s1": "http://y"},
                      indexer, "default", 4, SIM)


def test_a_poisoned_busy_until_is_bounded_and_forgotten_with_its_route() -> None:
    core = _core()
    poisoned = {"s0": ScoreRow(inflight=1, busy_until=1e12), "s1": ScoreRow()}
    back = core.backlog(10.0, poisoned)
    assert back["s0"] <= MAX_AHEAD_S  # bounded ahead of now, not 1e12
    # the route is gone from the index (released, expired): the rows say so, and the router follows
    back = core.backlog(20.0, {"s0": ScoreRow(), "s1": ScoreRow()})
    assert back["s0"] <= core.linger_s()
    back = core.backlog(20.0 + 2 * core.linger_s(), {"s0": ScoreRow(), "s1": ScoreRow()})
    assert back["s0"] == 0.0 and back["s1"] == 0.0


def test_route_calls_carry_the_indexer_token_and_refusals_are_counted() -> None:
    with LiveIndexer(ServiceConfig(port=free_port(), block_size=4, auth_token="sekret")) as idx:
        r = idx.client.post("/workers", json={"worker_id": "s0", "endpoint": f"tcp://127.0.0.1:{free_port()}",
                                              "model": "default", "block_size": 4})
        assert r.status_code == 201, r.text
        tokens = np.arange(1, 33, dtype=np.uint32)

        async def run(token: str | None) -> tuple[object, int]:
            core = _core(idx.url)
            if token:
                core.indexer_auth = {"Authorization": f"Bearer {token}"}
            try:
                got = await core.report_route("rid-" + str(token), "s0", tokens)
                await core.release_route("rid-" + str(token))
                return got, core.unauthorized
            finally:
                await core.close()

        got, refused = asyncio.run(run("sekret"))
        assert got is not None and refused == 0
        counts = idx.service.routes.pending.counts
        assert counts.added == 1 and counts.released == 1  # the release carried the token too
        got, refused = asyncio.run(run(None))
        assert got is None and refused == 2  # the report and the release, both refused
