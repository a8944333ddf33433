"""`POST /routes` / `DELETE /routes/{id}` and `/score`'s `pending_blocks` over real HTTP (uvicorn), and
two router replicas (the OpenAI router's indexer client, `POST /routes/decide`) sharing one indexer:
each decision counts the other's in-flight routes as pending blocks and load (docs/CONTRACTS.md,
"Pending routes")."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

import httpx

from router.proxy.indexer import IndexerClient
from router_api.decide import Candidate, DecideRequest
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


def _decide(rid: str, tokens: np.ndarray, choice: str | None = None, reserve: bool = True) -> DecideRequest:
    return DecideRequest(rid, [Candidate(w) for w in WIDS], "default", tokens=tokens.tobytes(), choice=choice,
                         reserve=reserve)


def test_two_router_replicas_see_each_others_routes(live: LiveIndexer) -> None:
    """Replica a's route is pending at the indexer for replica b's decision: the precise policy
    sends b's request sharing the system prompt to that worker, predicting the prefix as cached."""
    async def main() -> None:
        async with httpx.AsyncClient() as http:
            a = IndexerClient(live.url, http, None, release_every_s=3600.0)
            b = IndexerClient(live.url, http, None, release_every_s=3600.0)
            system = np.arange(100, 100 + 4 * BS, dtype=np.uint32)
            first = np.concatenate([system, np.arange(1000, 1000 + 2 * BS, dtype=np.uint32)])
            got = await a.decide(_decide("a-1", first, choice="rw2"))
            assert got.reserved and got.worker_id == "rw2" and got.pending_blocks == 0
            # replica b has not routed anything, yet its decision counts a's in-flight request on rw2
            second = np.concatenate([system, np.arange(5000, 5000 + 3 * BS, dtype=np.uint32)])
            d = await b.decide(_decide("b-1", second, reserve=False))
            assert d.worker_id == "rw2" and d.cached_blocks == 0 and d.pending_blocks == 4
            assert d.predicted_cached_tokens == 4 * BS
            rows = _rows(live, second.tolist())
            assert rows["rw2"]["pending_blocks"] == 4 and "pending_blocks" not in rows["rw0"]
            a.release("default", "a-1")
            await a.flush()
            assert "pending_blocks" not in _rows(live, second.tolist())["rw2"]
            await a.close()
            await b.close()

    asyncio.run(main())


def test_two_router_replicas_share_in_flight_load(live: LiveIndexer) -> None:
    """Replica a's route shows on `/score` rows as in-flight load on that worker (`pending_requests`,
    `pending_prefill_tokens`), and replica b's decision takes it: in a burst b does not pick the
    worker a just loaded, though b's own view of every worker is idle."""
    async def main() -> None:
        async with httpx.AsyncClient() as http:
            b = IndexerClient(live.url, http, None, release_every_s=3600.0)
            big = np.arange(20_000, 20_000 + 40 * BS + 3, dtype=np.uint32)  # 40 full blocks + 3 tokens
            other = np.arange(90_000, 90_000 + 8 * BS, dtype=np.uint32)  # shares nothing with `big`
            idle = await b.decide(_decide("probe-0", other, reserve=False))
            assert idle.worker_id == "rw0"  # every view idle: the tie goes to the first
            r = live.client.post("/routes", json={"request_id": "load-a", "worker_id": "rw0",
                                                  "token_ids": big.tolist()})
            assert r.status_code == 200, r.text
            by = _rows(live, other.tolist())
            assert (by["rw0"]["pending_requests"], by["rw0"]["pending_prefill_tokens"]) == (1, len(big))
            assert "pending_requests" not in by["rw1"] and by["rw0"]["cached_blocks"] == 0  # never mixed in
            d = await b.decide(_decide("probe-1", other, reserve=False))
            assert d.worker_id != "rw0"
            # a second route to rw0 sharing big's blocks adds only what those do not cover
            got = await b.decide(_decide("load-b", np.concatenate([big[:40 * BS], other]), choice="rw0"))
            assert got.reserved
            by = _rows(live, other.tolist())
            assert (by["rw0"]["pending_requests"], by["rw0"]["pending_prefill_tokens"]) == (2, len(big) + len(other))
            assert live.client.delete("/routes/load-a").json() == {"released": 40}
            b.release("default", "load-b")
            await b.flush()
            assert "pending_requests" not in _rows(live, other.tolist())["rw0"]
            await b.close()

    asyncio.run(main())
