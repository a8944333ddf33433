"""Causal forwarding at the indexer (docs/CONTRACTS.md, "Pending routes"): which routes a report
names in `after` (only those awaiting admission that hold its last pending block, by handle), the
admission and wait endpoints' answers and errors, and the embedded indexer's waits. Two router
replicas forwarding through one worker: tests/test_proxy_causal.py."""
from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from router.demo.procs import Child, wait_healthy
from router_api.config import ServiceConfig
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
