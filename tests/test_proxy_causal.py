"""Causal forwarding through the OpenAI router (docs/openai.md, "One round trip"; docs/CONTRACTS.md,
"Pending routes"): two router replicas (`ProxyCore`) share one indexer (real uvicorn) and one `kvatlas
worker` process. A request whose prediction counts another replica's pending blocks waits until the
worker admitted that route, reaches the worker after it and is served what it was promised; the
admission is reported without a call of its own (it rides on the replica's next decision or batch);
a wait whose route is never admitted times out, is counted, and the request goes on."""
from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest

from router.demo.procs import Child, wait_healthy
from router.proxy.core import ProxyCore, Route
from router.proxy.indexer import IndexerClient
from router_api.config import ServiceConfig
from router_api.decide import Candidate, DecideRequest
from router_api.routes import route_handle
from sim.api import WorkerHealth
from support.net import free_port, wait_until
from support.service import LiveIndexer

BS = 16
HEADERS = [(b"content-type", b"application/json")]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveIndexer, str, WorkerHealth]]:
    li = LiveIndexer(ServiceConfig(port=free_port(), block_size=BS, stats_ttl_s=0.0)).start()
    li.service.routes.pending.admit_timeout_s = 60.0  # these flows, not the admission deadline, end the waits
    wp = free_port()
    w = Child("worker", [sys.executable, "-m", "cli.main", "--log-level", "WARNING", "worker", "--id", "pw0",
                         "--port", str(wp), "--indexer", li.url, "--block-size", str(BS), "--gpu-pages", "256",
                         "--speed", "1000"], tmp_path_factory.mktemp("proxy-causal"))
    url = f"http://127.0.0.1:{wp}"
    try:
        wait_healthy([(w, url)])
        wait_until(lambda: any(r["worker_id"] == "pw0" and r["status"] == "live"
                               for r in li.client.get("/workers").json()["workers"]), timeout=60)
        health = msgspec.json.decode(httpx.get(f"{url}/health").content, type=WorkerHealth)
        yield li, url, health
    finally:
        w.stop()
        li.stop()


def _admission(li: LiveIndexer) -> dict:
    return li.client.get("/stats").json()["pending"]["admission"]


def _core(li: LiveIndexer, url: str, health: WorkerHealth, timeout_s: float) -> ProxyCore:
    return ProxyCore({"pw0": url}, indexer=li.url, model="default", tokenizer=None, policy="precise_tiered",
                     sim=health.sim, block_size=BS, admission_timeout_s=timeout_s, metrics_interval_s=30.0)


def _body(tokens: np.ndarray, stream: bool = False) -> dict[str, Any]:
    return {"model": "default", "prompt": tokens.tolist(), "max_tokens": 1, "stream": stream}


async def _served(core: ProxyCore, route: Route, body: dict[str, Any]) -> bytes:
    """Forward a decided route and read the engine's whole answer through the router's relay."""
    raw = json.dumps(body).encode()
    resp = await core.forward("/v1/completions", raw, body, HEADERS, route, False)
    return b"".join([c async for c in core.relay(resp, route)])


def _cached(answer: bytes) -> int:
    return int(json.loads(answer)["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_dependent_request_waits_for_admission_and_is_served_what_was_promised(
        fleet: tuple[LiveIndexer, str, WorkerHealth]) -> None:
    li, url, health = fleet
    system = np.arange(100, 100 + 4 * BS, dtype=np.uint32)
    q = np.concatenate([system, np.arange(1000, 1000 + 2 * BS, dtype=np.uint32)])
    r = np.concatenate([system, np.arange(5000, 5000 + 3 * BS, dtype=np.uint32)])

    async def main() -> None:
        a, b = _core(li, url, health, 30.0), _core(li, url, health, 30.0)
        await a.start()
        await b.start()
        before = _admission(li)
        try:
            # replica a decided q (its route is in flight at the indexer) but has not forwarded it yet
            rq = await a.route(_body(q), False)
            assert rq.reserved and rq.after == [] and rq.worker_id == "pw0"
            # replica b routes r, sharing q's system prompt: its prediction counts q's pending blocks,
            # so it must reach the worker after q
            rr = await b.route(_body(r), False)
            assert rr.after and rr.pending_tokens == 4 * BS and rr.cached_tokens == 4 * BS
            task = asyncio.get_running_loop().create_task(_served(b, rr, _body(r)))
            await asyncio.to_thread(wait_until, lambda: task.done() or _admission(li)["waiting"] == 1, 60)
            assert not task.done(), task.result()
            # q reaches the worker; a reports its admission on its next call (the batch: no request comes)
            q_answer = await _served(a, rq, _body(q, stream=True))
            r_answer = await asyncio.wait_for(task, 60)
            assert b"[DONE]" in q_answer
            # r ran after q: served from cache exactly what it was promised (q's system prompt)
            assert _cached(r_answer) == 4 * BS
            assert (b.counts["admission_waits"], b.counts["admission_timeouts"]) == (1, 0)
            # r's wait may end on q's store events before a's report goes out (its batch timer): the
            # report is sent all the same, once
            assert a.indexer is not None
            ia = a.indexer
            await asyncio.to_thread(wait_until, lambda: ia.counts["admitted"] >= 1, 30)
            assert ia.counts["admitted"] == 1
        finally:
            await a.close()
            await b.close()
        after = _admission(li)
        assert after["dependent"] - before["dependent"] == 1
        assert (after["waits"] - before["waits"], after["wait_timeouts"] - before["wait_timeouts"]) == (1, 0)
        assert after["waiting"] == 0

    asyncio.run(main())


def test_a_wait_for_a_route_never_admitted_times_out_counted(fleet: tuple[LiveIndexer, str, WorkerHealth]) -> None:
    li, url, health = fleet
    system = np.arange(300, 300 + 3 * BS, dtype=np.uint32)
    q = np.concatenate([system, np.arange(7000, 7000 + BS, dtype=np.uint32)])
    r = np.concatenate([system, np.arange(9000, 9000 + BS, dtype=np.uint32)])

    async def main() -> None:
        a, b = _core(li, url, health, 0.3), _core(li, url, health, 0.3)
        await a.start()
        await b.start()
        before = _admission(li)
        try:
            rq = await a.route(_body(q), False)  # its forward never happens
            assert rq.reserved
            rr = await b.route(_body(r), False)
            assert rr.after and rr.cached_tokens == 3 * BS
            answer = await _served(b, rr, _body(r))
            # the promise was not kept (q never landed): nothing was cached, and the wait is counted
            assert _cached(answer) == 0
            assert (b.counts["admission_waits"], b.counts["admission_timeouts"]) == (1, 1)
        finally:
            a.release(rq)
            await a.close()
            await b.close()
        after = _admission(li)
        assert (after["waits"] - before["waits"], after["wait_timeouts"] - before["wait_timeouts"]) == (1, 1)

    asyncio.run(main())


def test_admissions_and_releases_ride_on_the_next_decision(fleet: tuple[LiveIndexer, str, WorkerHealth]) -> None:
    """One call per request: an admission queued by the router goes out inside its next
    `/routes/decide` (applied before that decision), never as a call of its own."""
    li, _, _ = fleet
    toks = np.arange(60_000, 60_000 + 3 * BS, dtype=np.uint32)
    more = np.concatenate([toks, np.arange(61_000, 61_000 + BS, dtype=np.uint32)])

    async def main() -> None:
        async with httpx.AsyncClient() as http:
            client = IndexerClient(li.url, http, None, release_every_s=3600.0)  # no flusher: nothing but decides

            def req(rid: str, t: np.ndarray) -> DecideRequest:
                return DecideRequest(rid, [Candidate("pw0")], "default", tokens=t.tobytes(), admits=True)

            first = await client.decide(req("ride-q", toks))
            assert first.reserved and first.after == []
            second = await client.decide(req("ride-r", more))
            handle = route_handle(li.service.routes.handle_key, "default", "ride-q")
            assert second.after == [handle]  # q holds r's last pending block, not admitted yet
            before = _admission(li)["admitted"]
            client.admitted("default", "ride-q")
            client.release("default", "ride-r")
            assert client._timer is None  # not started: only a decision carries the reports
            third = await client.decide(req("ride-s", more))
            # q's admission and r's release were applied before s was decided: s depends on nothing
            assert third.after == [] and third.pending_blocks == 3
            assert _admission(li)["admitted"] - before == 1
            assert client.counts["admitted"] == 1 and client.counts["released"] == 1
            got = li.client.post("/routes/wait", json={"request_ids": [handle], "timeout_s": 30}).json()
            assert got["waiting"] == []
            for rid in ("ride-q", "ride-s"):
                client.release("default", rid)
            await client.close()

    asyncio.run(main())
