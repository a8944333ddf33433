"""A fleet of real ZeroMQ publishers registered with a live indexer, each driven by a `WorkerSim` and
mirrored into the brute-force reference (test_service_ingest, _sharded, _snapshot, test_dashboard)."""
from __future__ import annotations

import random
import time
from typing import Any

import httpx
import pytest

from producer.publisher import ZmqEventPublisher
from schemas.events import KVEventBatch
from support.net import free_port
from support.reference import ReferenceIndex
from support.service import WorkerSim, make_prompts, wait_applied

BS = 4


class Fleet:
    """N real publishers, each driven by a WorkerSim and mirrored into a ReferenceIndex."""

    def __init__(self, client: httpx.Client, n: int, *, seed: int = 0, buffer_steps: int = 10_000,
                 prefix: str = "w") -> None:
        self.client = client
        self.ref = ReferenceIndex()
        self.ref.ensure_model("default", BS)
        prompts = make_prompts(seed, BS)
        self.pubs: dict[str, ZmqEventPublisher] = {}
        self.sims: dict[str, WorkerSim] = {}
        self.endpoints: dict[str, tuple[str, str]] = {}
        for i in range(n):
            wid = f"{prefix}{i}"
            ep, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            self.endpoints[wid] = (ep, rep)
            self.pubs[wid] = ZmqEventPublisher(ep, replay_endpoint=rep, buffer_steps=buffer_steps)
            self.sims[wid] = WorkerSim(seed * 100 + i, BS, prompts)
            self.ref.register_worker("default", wid, 0)
            r = client.post("/workers", json={"worker_id": wid, "endpoint": ep, "replay_endpoint": rep,
                                              "block_size": BS})
            assert r.status_code == 201, r.text

    def connect(self) -> dict[str, dict[str, Any]]:
        """Heartbeat until every subscription is up (a PUB drops what it sends before that);
        returns the /workers rows at that point, to compare counters against."""
        self.settle({wid: 0 for wid in self.pubs})
        return {w["worker_id"]: w for w in self.client.get("/workers").json()["workers"]}

    def publish(self, wid: str, events: list) -> int:
        # next_seq is the seq the next batch *sent* carries: exact only once the queue is empty.
        self.pubs[wid].flush(10)
        seq = self.pubs[wid].next_seq
        self.pubs[wid].publish(events)
        self.ref.apply("default", wid, 0, KVEventBatch(time.time(), events))
        return seq

    def run(self, steps: int, rng: random.Random) -> dict[str, int]:
        """Interleave `steps` scheduler steps per worker; returns each worker's last seq."""
        last: dict[str, int] = {}
        order = [wid for wid in self.sims for _ in range(steps)]
        rng.shuffle(order)
        for wid in order:
            last[wid] = self.publish(wid, self.sims[wid].step())
        for p in self.pubs.values():
            p.flush(10)
        return last

    def settle(self, marks: dict[str, int]) -> None:
        wait_applied(self.client, marks, pubs=self.pubs)
        for p in self.pubs.values():  # heartbeats of the last probe sent: next_seq is exact again
            p.flush(10)

    def check_reference(self, queries: list[list[int]]) -> None:
        for q in queries:
            body = self.client.post("/score", json={"token_ids": q}).json()
            got = {(w["worker_id"], w["dp_rank"]): w for w in body["workers"]}
            ref = self.ref.score("default", q)
            for ws in ref.workers:
                g = got[(ws.worker_id, ws.dp_rank)]
                assert (g["device_blocks"], g["cached_blocks"], g["tiers"]) == (
                    ws.device_blocks, ws.cached_blocks, ws.tiers), (ws, g)
                assert g["score"] == pytest.approx(ws.score)

    def close(self) -> None:
        for p in self.pubs.values():
            p.close()
