"""`POST /routes` / `DELETE /routes/{id}` and `/score`'s `pending_blocks` over real HTTP (uvicorn), and
two router replicas (`RouterCore`, real httpx) sharing one indexer: each sees the other's reported
routes as pending, and its precise policy follows them (docs/CONTRACTS.md, "Pending routes")."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from sim.api import SimModel
from router_api.router.forwarder import RouterCore
from router_api.router.policies import make_policy
from router_api.config import ServiceConfig
from support.net import free_port
from support.service import LiveIndexer, indexer_with_publishers

BS = 16
WIDS = ["rw0", "rw1", "rw2"]


@pytest.fixture(scope="module")
def live() -> Iterator[LiveIndexer]:
    with indexer_with_publishers(ServiceConfig(port=free_port(), block_size=BS, stats_ttl_s=0.0), WIDS, BS) as li:
        yield li


def _rows(li: LiveIndexer, tokens: list[int]) -> dict[str, dict]:
    r = li.client.post("/score", json={"token_ids": tokens})
    assert r.status_code == 200, r.text
    return {w["worker_id"]: w for w in r.json()["workers"]}


def test_report_score_release_over_http(live: LiveIndexer) -> None:
    toks = list(range(1, 3 * BS + 5))  # 3 full blocks
    assert all(w.get("pending_blocks", 0) == 0 for w in _rows(live, toks).values())
    r = live.client.post("/routes", json={"request_id": "h1", "worker_id": "rw1", "token_ids": toks})
    assert r.status_code == 200, r.text
    assert r.json() == {"request_id": "h1", "pending_blocks": 0, "cached_blocks": 0, "blocks": 3, "after": []}
    rows = _rows(live, toks + [9] * BS)
    assert rows["rw1"]["pending_blocks"] == 3 and rows["rw1"]["cached_blocks"] == 0
    assert rows["rw1"]["device_blocks"] == 0 and rows["rw1"]["tiers"] == {"gpu": 0, "host": 0, "disk": 0, "shared": 0}
    assert "pending_blocks" not in rows["rw0"]  # zero: omitted, like the C writer's rows
    # a second route to the same worker sees the first one's blocks as pending there (msgpack body)
    body = msgspec.msgpack.encode({"request_id": "h2", "worker_id": "rw1", "token_ids": toks[:2 * BS]})
    r = live.client.post("/routes", content=body, headers={"Content-Type": "application/msgpack"})
    assert r.json() == {"request_id": "h2", "pending_blocks": 2, "cached_blocks": 0, "blocks": 2, "after": []}
    assert live.client.delete("/routes/h1").json() == {"released": 3}
    assert live.client.delete("/routes/h1").json() == {"released": 0}  # idempotent
    assert _rows(live, toks)["rw1"]["pending_blocks"] == 2
    assert live.client.delete("/routes/h2", params={"model": "default"}).json() == {"released": 2}
    assert all(w.get("pending_blocks", 0) == 0 for w in _rows(live, toks).values())
    metrics = live.client.get("/metrics").text
    assert 'kvatlas_pending_routes_total{outcome="added"} 2' in metrics
    assert 'kvatlas_pending_routes_total{outcome="released"} 2' in metrics
    assert live.client.get("/stats").json()["pending"]["routes"] == 0


@pytest.mark.parametrize("body,status", [
    ({"request_id": "x", "worker_id": "nope", "token_ids": [1, 2]}, 404),
    ({"request_id": "x", "worker_id": "rw0", "token_ids": [1, 2], "model": "other"}, 404),
    ({"request_id": "x", "worker_id": "rw0", "token_ids": [-1]}, 422),
    ({"request_id": "x", "worker_id": "rw0"}, 422),
    ({"request_id": "x", "worker_id": "rw0", "token_ids": [1], "surprise": 1}, 422),
])
def test_bad_route_reports_are_clear_errors(live: LiveIndexer, body: dict, status: int) -> None:
    r = live.client.post("/routes", json=body)
    assert r.status_code == status and r.json()["error"], r.text
    assert live.client.post("/routes", content=b"{not json", headers={"Content-Type": "application/json"}
                            ).status_code == 400


def test_two_router_replicas_see_each_others_routes(live: LiveIndexer) -> None:
    sim = SimModel()
    workers = {w: "http://127.0.0.1:9" for w in WIDS}  # never called: only the indexer is

    async def main() -> None:
        a = RouterCore(make_policy("precise_tiered", WIDS, sim), workers, live.url, "default", BS, sim)
        b = RouterCore(make_policy("precise_tiered", WIDS, sim, seed=1), workers, live.url, "default", BS, sim)
        try:
            system = np.arange(100, 100 + 4 * BS, dtype=np.uint32)
            first = np.concatenate([system, np.arange(1000, 1000 + 2 * BS, dtype=np.uint32)])
            got = await a.report_route("a-1", "rw2", first)
            assert got is not None and got["blocks"] == 6
            # replica b has not routed anything, yet sees a's in-flight request on rw2
            second = np.concatenate([system, np.arange(5000, 5000 + 3 * BS, dtype=np.uint32)])
            rows = await b.score(second)
            assert rows["rw2"].pending == 4 and rows["rw2"].cached == 0 and rows["rw0"].pending == 0
            # and its precise policy sends the request sharing the system prompt there
            from router_api.router.policies import RouteInput
            d = b.policy.choose(RouteInput(len(second), [], BS, rows, {w: 0.0 for w in WIDS},
                                           {w: 0 for w in WIDS}))
            assert d.worker_id == "rw2" and d.predicted_cached == 4 * BS and d.predicted_pending == 4 * BS
            await a.release_route("a-1")
            assert (await b.score(second))["rw2"].pending == 0
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())


def test_two_router_replicas_share_in_flight_load(live: LiveIndexer) -> None:
    """Replica a's route shows on replica b's `/score` rows as in-flight load on that worker
    (`pending_requests`, `pending_prefill_tokens`), and b's queue estimate and precise policy take it:
    in a burst b does not pick the worker a just loaded, though its own view of that worker is idle."""
    sim = SimModel()
    workers = {w: "http://127.0.0.1:9" for w in WIDS}

    async def main() -> None:
        a = RouterCore(make_policy("precise_tiered", WIDS, sim), workers, live.url, "default", BS, sim)
        b = RouterCore(make_policy("precise_tiered", WIDS, sim), workers, live.url, "default", BS, sim)
        try:
            big = np.arange(20_000, 20_000 + 40 * BS + 3, dtype=np.uint32)  # 40 full blocks + 3 tokens
            # a router that reports no end time (e.g. the OpenAI proxy): its route's prefill is the shared view
            r = live.client.post("/routes", json={"request_id": "load-a", "worker_id": "rw0", "token_ids": big.tolist()})
            assert r.status_code == 200, r.text
            other = np.arange(90_000, 90_000 + 8 * BS, dtype=np.uint32)  # shares nothing with `big`
            rows = await b.score(other)
            assert (rows["rw0"].inflight, rows["rw0"].inflight_prefill) == (1, len(big))
            assert (rows["rw1"].inflight, rows["rw1"].inflight_prefill) == (0, 0)
            r = live.client.post("/score", json={"token_ids": other.tolist()}).json()["workers"]
            by = {w["worker_id"]: w for w in r}
            assert (by["rw0"]["pending_requests"], by["rw0"]["pending_prefill_tokens"]) == (1, len(big))
            assert "pending_requests" not in by["rw1"] and by["rw0"]["cached_blocks"] == 0  # never mixed in
            now = b.now()
            own = b.backlog(now)  # b's own view: it has sent nothing, and no worker reported load
            backlog = b.backlog(now, rows)
            assert backlog["rw0"] >= sim.prefill_s(len(big)) - 1e-9 and backlog["rw1"] == backlog["rw2"] == 0.0
            from router_api.router.policies import RouteInput
            # b has sent nothing: its own view alone ties the three workers and breaks the tie on rw0
            assert b.policy.choose(RouteInput(len(other), [], BS, {}, own, {w: 0 for w in WIDS})
                                   ).worker_id == "rw0"
            b.policy.assigned = {w: 0.0 for w in WIDS}
            d = b.policy.choose(RouteInput(len(other), [], BS, rows, backlog, {w: 0 for w in WIDS}))
            assert d.worker_id != "rw0"
            # a second route to rw0 sharing big's blocks adds only what those do not cover
            await b.report_route("load-b", "rw0", np.concatenate([big[:40 * BS], other]))
            rows = await a.score(other)
            assert (rows["rw0"].inflight, rows["rw0"].inflight_prefill) == (2, len(big) + len(other))
            assert live.client.delete("/routes/load-a").json() == {"released": 40}
            await b.release_route("load-b")
            rows = await a.score(other)
            assert rows["rw0"].inflight == rows["rw0"].inflight_prefill == 0
            # the shared view is kept as an end time: the confirmed/released route's work still counts
            assert b.backlog(now, rows)["rw0"] == backlog["rw0"]
            # a route carries its router's own end time for the worker; every replica reads it on the rows
            # while the route is held, and forgets it with the route
            a.busy_until["rw2"] = now + 7.5
            await a.report_route("busy-a", "rw2", other)
            rows = await b.score(other)
            assert rows["rw2"].busy_until == now + 7.5 and rows["rw1"].busy_until is None
            assert b.backlog(now, rows)["rw2"] == pytest.approx(7.5)
            await a.release_route("busy-a")
            assert (await b.score(other))["rw2"].busy_until is None
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())
