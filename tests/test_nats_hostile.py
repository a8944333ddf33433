"""Hostile parties on the NATS plane (issue 24): a registration that claims another worker's
JetStream subject (over HTTP or written straight into the shared-registry bucket) is refused and
never changes the owner's answers; a relayed batch larger than the server's max_payload never
leaves a hole in the stream; a publisher seq at or above 2^63 is relayed like any other."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from indexer.shared_registry import SharedRegistry
from producer.jetstream_publisher import JetStreamEventPublisher
from schemas.api import RegisterWorker
from schemas.jetstream import DEFAULT_KV_BUCKET, jetstream_endpoint
from schemas.natsio import NatsThread
from support.jetstream import subject_last_seq
from support.nats import NatsServer
from support.net import free_port, wait_until
from support.service import KVIndexerProcess, WorkerSim, check_scores, make_prompts

BS = 4
MODEL = "default"


@pytest.fixture(name="nats")
def nats_fixture() -> Iterator[NatsServer]:
    with NatsServer() as srv:
        yield srv


def _rows(r: KVIndexerProcess) -> dict[str, dict]:
    return {w["worker_id"]: w for w in r.client.get("/workers").json()["workers"]}


def _drive(pub: JetStreamEventPublisher, sim: WorkerSim, steps: int) -> None:
    for _ in range(steps):
        pub.publish(sim.step())
    assert pub.flush(10.0)


def _applied(r: KVIndexerProcess, wid: str, mark: int) -> None:
    wait_until(lambda: (_rows(r).get(wid, {}).get("last_seq") or 0) >= mark, timeout=30.0, interval=0.05)


def test_a_jetstream_subject_has_one_worker_over_http_and_the_bucket(nats: NatsServer, tmp_path: Path) -> None:
    r = KVIndexerProcess(free_port(), "--nats", nats.url, "--block-size", str(BS), log_path=tmp_path / "r.log")
    r.wait_ready()
    nt = NatsThread(nats.url)
    bucket = SharedRegistry(nt, DEFAULT_KV_BUCKET)
    pub = JetStreamEventPublisher(nats.url, model=MODEL, worker_id="a")
    sim = WorkerSim(1, BS, make_prompts(7, BS))
    try:
        own = jetstream_endpoint(MODEL, "a")
        assert r.client.post("/workers", json={"worker_id": "a", "endpoint": own, "block_size": BS}).status_code == 201
        # The same subject under another id (the topic is no ZeroMQ filter here) is refused.
        for body in ({"worker_id": "thief", "endpoint": own, "block_size": BS, "topic": "x"},
                     {"worker_id": "thief", "endpoint": own, "block_size": BS}):
            resp = r.client.post("/workers", json=body)
            assert resp.status_code in (400, 409), resp.text
            assert "subject" in resp.text or "already registered" in resp.text, resp.text
        # Written straight into the bucket: every replica refuses to apply it (counted).
        bucket.put(RegisterWorker(worker_id="thief", endpoint=own, block_size=BS, topic="x"))
        wait_until(lambda: 'kvatlas_shared_registry_errors_total{op="apply_put"}' in r.client.get("/metrics").text,
                   timeout=20.0, interval=0.05)
        assert set(_rows(r)) == {"a"}
        _drive(pub, sim, 30)
        _applied(r, "a", subject_last_seq(pub))
        queries = sim.sample_queries(10)
        assert check_scores(r.client, {"a": sim}, queries) == len(queries)
        # The hostile entry deleted: the owner still gets its new blocks.
        bucket.delete("thief")
        _drive(pub, sim, 30)
        _applied(r, "a", subject_last_seq(pub))
        queries = sim.sample_queries(10)
        assert check_scores(r.client, {"a": sim}, queries) == len(queries)
    finally:
        pub.close()
        bucket.close()
        nt.close()
        r.terminate()
