"""Causal forwarding (docs/CONTRACTS.md, "Pending routes"): a route whose prediction counts another
route's pending blocks is forwarded only once the worker admitted that route. Two router replicas
(`RouterCore`, real httpx) share one indexer (real uvicorn) and one `kvatlas worker` process: the
dependent request waits for the other's admission, reaches the worker after it and is served what it
was promised; a wait whose route is never admitted times out, is counted, and the request goes on.
The embedded indexer waits the same way."""
from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator

import httpx
import msgspec
import numpy as np
import pytest

from sim.api import GenerateResponse, WorkerHealth
from router_api.config import ServiceConfig
from router.demo.procs import Child, wait_healthy
from router.forwarder import RouterCore, fetch_sim
from router.policies import make_policy
from router.report import mismatch_cause
from router_api.routes import route_handle
from support.net import free_port, wait_until
from support.service import LiveIndexer

BS = 16


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveIndexer, str]]:
    li = LiveIndexer(ServiceConfig(port=free_port(), block_size=BS, stats_ttl_s=0.0)).start()
    li.service.routes.pending.admit_timeout_s = 60.0  # these flows, not the admission deadline, end the waits
    wp = free_port()
    w = Child("worker", [sys.executable, "-m", "cli.main", "--log-level", "WARNING", "worker", "--id", "cw0",
                         "--port", str(wp), "--indexer", li.url, "--block-size", str(BS), "--gpu-pages", "256",
                         "--speed", "1000"], tmp_path_factory.mktemp("causal"))
    url = f"http://127.0.0.1:{wp}"
    try:
        wait_healthy([(w, url)])
        wait_until(lambda: any(r["worker_id"] == "cw0" and r["status"] == "live"
                               for r in li.client.get("/workers").json()["workers"]), timeout=60)
        yield li, url
    finally:
        w.stop()
        li.stop()


def _admission(li: LiveIndexer) -> dict:
    return li.client.get("/stats").json()["pending"]["admission"]


def _core(li: LiveIndexer, url: str, health: WorkerHealth, timeout_s: float) -> RouterCore:
    return RouterCore(make_policy("precise_tiered", ["cw0"], health.sim), {"cw0": url}, li.url, "default", BS,
                      health.sim, admission_timeout_s=timeout_s)


async def _two_cores(li: LiveIndexer, url: str, timeout_s: float) -> tuple[RouterCore, RouterCore]:
    """Two router replicas over the one worker, each waiting up to `timeout_s` for admissions."""
    async with httpx.AsyncClient() as c:
        health = await fetch_sim(c, url)
    return _core(li, url, health, timeout_s), _core(li, url, health, timeout_s)


def test_a_dependent_route_waits_for_admission_and_runs_after(fleet: tuple[LiveIndexer, str]) -> None:
    li, url = fleet
    system = np.arange(100, 100 + 4 * BS, dtype=np.uint32)
    q = np.concatenate([system, np.arange(1000, 1000 + 2 * BS, dtype=np.uint32)])
    r = np.concatenate([system, np.arange(5000, 5000 + 3 * BS, dtype=np.uint32)])

    async def main() -> None:
        a, b = await _two_cores(li, url, 30.0)
        before = _admission(li)
        try:
            # replica a decided q (its route is in the index) but its forward has not reached the worker
            got = await a.report_route("a-q", "cw0", q)
            assert got is not None and got["after"] == [] and got["blocks"] == 6
            # replica b routes r, which shares q's system prompt: its prediction counts q's pending
            # blocks, so it must reach the worker after q
            task = asyncio.get_running_loop().create_task(b.handle(1, r, 1, request_id="r"))
            await asyncio.to_thread(wait_until, lambda: task.done() or _admission(li)["waiting"] == 1, 60)
            assert not task.done(), task.result()
            # now q reaches the worker; its answer begins at admission, and a reports it
            async with a.client.stream("POST", f"{url}/generate", json={"token_ids": q.tolist(), "max_tokens": 1,
                                                                       "request_id": "q"}) as resp:
                assert resp.status_code == 200
                a.admitted("a-q")
                q_served = msgspec.json.decode(await resp.aread(), type=GenerateResponse)
            rec, out = await task
            assert out is not None and rec.error is None
            assert rec.wait_s is not None and not rec.wait_timeout
            # r ran after q: served from cache exactly what it was promised (q's system prompt)
            assert rec.predicted_cached == rec.predicted_pending == 4 * BS
            assert rec.served is not None and rec.served.cached == 4 * BS == rec.arrival_cached
            assert q_served.arrival_cached == 0
        finally:
            await a.release_route("a-q")
            await a.close()
            await b.close()
        after = _admission(li)
        assert after["dependent"] - before["dependent"] == 1
        assert (after["waits"] - before["waits"], after["wait_timeouts"] - before["wait_timeouts"]) == (1, 0)
        # a-q's and b's own admissions count only for routes still held when the reports arrive: the
        # worker's events may confirm either route first (the route timer's sweep runs without traffic),
        # and admitting a route that left is a no-op. The wait above ending without a timeout is the proof.
        assert after["admitted"] - before["admitted"] <= 2
        assert after["waiting"] == 0

    asyncio.run(main())


def test_a_wait_for_a_route_never_admitted_times_out_counted(fleet: tuple[LiveIndexer, str]) -> None:
    li, url = fleet
    system = np.arange(300, 300 + 3 * BS, dtype=np.uint32)
    q = np.concatenate([system, np.arange(7000, 7000 + BS, dtype=np.uint32)])
    r = np.concatenate([system, np.arange(9000, 9000 + BS, dtype=np.uint32)])

    async def main() -> None:
        a, b = await _two_cores(li, url, 0.3)
        before = _admission(li)
        try:
            got = await a.report_route("a-lost", "cw0", q)  # its forward never happens
            assert got is not None
            rec, out = await b.handle(2, r, 1, request_id="r2")
            assert out is not None and rec.wait_timeout and rec.wait_s is not None
            # the promise was not kept: the cause is the route that never landed
            assert rec.served is not None and rec.served.cached == 0 and mismatch_cause(rec) == "unlanded"
        finally:
            await a.release_route("a-lost")
            await a.close()
            await b.close()
        after = _admission(li)
        assert (after["waits"] - before["waits"], after["wait_timeouts"] - before["wait_timeouts"]) == (1, 1)
        text = li.client.get("/metrics").text
        assert 'kvatlas_pending_admission_total{what="wait_timeouts"}' in text

    asyncio.run(main())


def test_a_route_without_dependencies_never_waits(fleet: tuple[LiveIndexer, str]) -> None:
    """No pending block counted, or one held by an admitted route: `after` is empty, nothing waits."""
    li, url = fleet
    q = np.arange(40_000, 40_000 + 3 * BS, dtype=np.uint32)
    r = np.concatenate([q, np.arange(41_000, 41_000 + BS, dtype=np.uint32)])
    report = lambda rid, toks: li.client.post("/routes", json={"request_id": rid, "worker_id": "cw0",  # noqa: E731
                                                               "token_ids": toks.tolist(), "admits": True}).json()
    h = lambda rid: route_handle(li.service.routes.handle_key, "default", rid)  # noqa: E731  (never the id)
    try:
        assert report("n-q", q)["after"] == []
        assert report("n-r", r)["after"] == [h("n-q")]  # q holds r's last pending block, not admitted yet
        assert li.client.post("/routes/admitted", json={"request_id": "n-q"}).json() == {"admitted": True}
        assert li.client.post("/routes/admitted", json={"request_id": "n-q"}).json() == {"admitted": False}
        assert report("n-s", r)["after"] == [h("n-r")]  # r's last block: only n-r holds it
        # q's last block: n-r (awaiting) holds it, but so does n-q, admitted: the worker has it queued
        assert report("n-t", q)["after"] == []
        got = li.client.post("/routes/wait", json={"request_ids": [h("n-q"), "unknown"], "timeout_s": 30}).json()
        assert got["waiting"] == []
    finally:
        for rid in ("n-q", "n-r", "n-s", "n-t"):
            li.client.delete(f"/routes/{rid}")


@pytest.mark.parametrize("body", [{"request_ids": ["x"], "timeout_s": 31}, {"request_ids": "x"},
                                  {"request_ids": ["x"], "surprise": 1}])
def test_bad_waits_are_clear_errors(fleet: tuple[LiveIndexer, str], body: dict) -> None:
    li, _ = fleet
    r = li.client.post("/routes/wait", json=body)
    assert r.status_code == 422 and r.json()["error"], r.text
    assert li.client.post("/routes/admitted", json={}).status_code == 422


def test_embedded_indexer_waits_for_admission() -> None:
    from router_api.embedded import EmbeddedIndexer

    idx = EmbeddedIndexer(block_size=BS)
    try:
        idx.add_worker({"worker_id": "e0", "endpoint": "tcp://127.0.0.1:1"})
        toks = list(range(1, 3 * BS + 1))
        q, r = (route_handle(idx.service.routes.handle_key, idx.model, rid) for rid in ("q", "r"))
        assert idx.route(None, "q", "e0", toks).after == []
        assert idx.route(None, "r", "e0", toks + [7] * BS).after == [q]
        assert sorted(idx.route(None, "s", "e0", toks).after) == sorted([q, r])  # both hold its last block
        assert idx.wait_routes(None, [q], timeout_s=0.05) == [q]  # not admitted: timed out
        assert idx.wait_routes(None, [q, "gone"], timeout_s=60) == [q]  # one is not awaiting: at once
        assert idx.admit_route(None, "r")
        assert idx.wait_routes(None, [q, r], timeout_s=60) == [q]  # one admitted suffices
        admitter = threading.Thread(target=lambda: idx.admit_route(None, "q"))
        done: list[list[str]] = []
        waiter = threading.Thread(target=lambda: done.append(idx.wait_routes(None, [q], timeout_s=60)))
        waiter.start()
        admitter.start()
        waiter.join(90)
        admitter.join(90)
        assert done == [[]]
        stats = idx.service.routes.admission
        assert stats.admitted == 2 and stats.wait_timeouts == 1
    finally:
        idx.close()
