"""Hostile publishers beside honest ones on the NATS path (issue 24; docs/limits.md): one
`kvatlas indexer --nats` replica; honest ZeroMQ workers (one registered directly, counting from
2^63) and honest JetStream workers (one of them sometimes storing batches
over NATS's 1 MiB max_payload) and an honest ZeroMQ engine behind `kvatlas relay` counting from
seq 2^63, and an honest hybrid JetStream worker; meanwhile a hybrid group flood over JetStream
(10,000 single-block sliding-window groups and a 30,000-block chain, the chain scored at 480k tokens
in a loop), a thief claims the honest subjects (over HTTP and straight into the bucket), a raw
publisher writes junk on an honest subject, and slowloris clients hold the HTTP port. After
quiescence every honest worker's answers are exact, the hostile parties are counted, /health
kept answering, the indexer's RSS stayed bounded.

Short by default (inside `make test`: exactness, and /health answered); `KVATLAS_SOAK_S=60` runs
longer, and then also holds /health p99 under 100 ms. Loopback only. The ZeroMQ twin:
test_soak_hostile_zmq.py."""
from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from indexer.core.groups import GROUP_CAP
from indexer.shared_registry import SharedRegistry
from transport.jetstream_publisher import JetStreamEventPublisher
from producer.publisher import ZmqEventPublisher
from router_api.relay import Relay, RelayWorker
from schemas.api import RegisterWorker
from schemas.events import BlockStored, KVEventBatch
from schemas.frames import seq_bytes
from schemas.jetstream import DEFAULT_KV_BUCKET, event_subject, jetstream_endpoint
from transport.natsio import NatsThread
from support.hostile import (FLOOD_BS, HighSeqPublisher, start_flood, wait_applied, stop_parties, check_hybrid_beside_flood, check_soak_end, GroupFlood, honest_hybrid,
                             rss_kb, slowloris)
from support.jetstream import subject_last_seq
from support.nats import NatsServer
from support.net import free_port, wait_until
from support.service import KVIndexerProcess, WorkerSim, check_scores, make_prompts

BS = 4
MODEL = "default"
SOAK_S = float(os.environ.get("KVATLAS_SOAK_S", "5"))
LONG = SOAK_S >= 30


class _RelayedEngine:
    """An honest ZeroMQ engine counting from 2^63 + 100, relayed into JetStream in a thread."""

    def __init__(self, nats_url: str, wid: str) -> None:
        self.wid = wid
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.relay = Relay(nats_url, [RelayWorker(wid, f"tcp://127.0.0.1:{port}", None, MODEL, BS)],
                           registry_bucket=DEFAULT_KV_BUCKET, replay_timeout=1.0)
        self.seq = (1 << 63) + 100
        self.enc = msgspec.msgpack.Encoder()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        # ZeroMQ slow joiner: empty batches until the relay reads us (the stream then opens with
        # one gap, before any block: the relay joined a publisher already at 2^63 + 100)
        wait_until(lambda: (self.send([]), self.relay.sub.watermark(wid) is not None)[1], timeout=20.0,
                   interval=0.02)

    def _run(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                self.relay.step(10)

    def send(self, events: list) -> None:
        self.pub.send_multipart([b"", seq_bytes(self.seq), self.enc.encode(KVEventBatch(time.time(), events))])
        self.seq += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.relay.close()
        self.pub.close(0)


def test_hostile_publishers_beside_honest_ones_on_nats(nats: NatsServer, tmp_path: Path) -> None:
    r = KVIndexerProcess(free_port(), "--nats", nats.url, "--block-size", str(BS), "--http-request-timeout", "2",
                         log_path=tmp_path / "indexer.log")
    r.wait_ready()
    nt = NatsThread(nats.url)
    bucket = SharedRegistry(nt, DEFAULT_KV_BUCKET)
    honest = {f"h{i}": WorkerSim(i, BS, make_prompts(100 + i, BS)) for i in range(3)}
    pubs = {w: JetStreamEventPublisher(nats.url, model=MODEL, worker_id=w) for w in honest}
    engine = _RelayedEngine(nats.url, "z0")
    # ZeroMQ beside it: an honest engine (q0) and a raw publisher past 2^63 registered directly (u0)
    q_sim = WorkerSim(9, BS, make_prompts(109, BS))
    q_pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    u_pub = HighSeqPublisher()  # honest content, seqs from 2^63 + 7
    rng = random.Random(7)
    flood = GroupFlood(11)
    hh_events, hh_prompt = honest_hybrid(12)
    hyb_pubs = {w: JetStreamEventPublisher(nats.url, model="hyb", worker_id=w) for w in ("flood", "hh")}
    slow: list = []
    probe = scorer = None
    try:
        for w in honest:
            assert r.client.post("/workers", json={"worker_id": w, "endpoint": jetstream_endpoint(MODEL, w),
                                                   "block_size": BS}).status_code == 201
        for w in hyb_pubs:
            assert r.client.post("/workers", json={"worker_id": w, "endpoint": jetstream_endpoint("hyb", w),
                                                   "model": "hyb", "block_size": FLOOD_BS}).status_code == 201
        wait_until(lambda: "z0" in {x["worker_id"] for x in r.client.get("/workers").json()["workers"]},
                   timeout=20.0, interval=0.05)
        for wid, ep, rep_ep in (("q0", q_pub.endpoint, q_pub.replay_endpoint), ("u0", u_pub.endpoint, None)):
            body = {"worker_id": wid, "endpoint": ep, "block_size": BS, **({"replay_endpoint": rep_ep} if rep_ep else {})}
            assert r.client.post("/workers", json=body).status_code == 201

        def zmq_joined() -> bool:
            q_pub.heartbeat()
            u_pub.send([])
            rows = {x["worker_id"]: x for x in r.client.get("/workers").json()["workers"]}
            return all(rows[w]["last_seq"] is not None for w in ("q0", "u0"))
        wait_until(zmq_joined, timeout=20.0, interval=0.05)
        honest["q0"] = q_sim
        rss0 = rss_kb(r.proc.pid)
        probe, scorer = start_flood(r.url, hyb_pubs["hh"], hyb_pubs["flood"], hh_events, flood)
        big_pub = JetStreamEventPublisher(nats.url, model=MODEL, worker_id="big")
        assert r.client.post("/workers", json={"worker_id": "big", "endpoint": jetstream_endpoint(MODEL, "big"),
                                               "block_size": BS}).status_code == 201
        big_chain: list[int] = []
        big_parent: int | None = None
        parent_z: int | None = None
        z_chain: list[int] = []
        end = time.monotonic() + SOAK_S
        rounds = thefts = 0
        while time.monotonic() < end:
            rounds += 1
            for w, sim in honest.items():
                (q_pub if w == "q0" else pubs[w]).publish(sim.step())
            if rounds % 2 == 1:
                hyb_pubs["flood"].publish(flood.groups())
            if rounds % 50 == 1 and len(big_chain) < 2 * 40_000 * BS:  # batches over the 1 MiB max_payload
                big = BlockStored([rng.randrange(1, 1 << 62) for _ in range(40_000)], big_parent,
                                  [rng.randrange(1 << 20, 1 << 30) for _ in range(40_000 * BS)], BS)
                big_parent = big.block_hashes[-1]
                big_chain.extend(big.token_ids)
                big_pub.publish([big])
                q_pub.publish([big])  # the same 1.2 MB batch over ZeroMQ (64 MiB cap there)
            ev = BlockStored([rng.randrange(1, 1 << 62)], parent_z, [rng.randrange(1, 1 << 30) for _ in range(BS)], BS)
            parent_z = ev.block_hashes[0]
            z_chain.extend(ev.token_ids)
            engine.send([ev])
            u_pub.send([ev])
            if rounds % 10 == 0:  # the thief, over HTTP and in the bucket
                victim = rng.choice(list(honest))
                resp = r.client.post("/workers", json={"worker_id": f"thief{rounds}", "block_size": BS,
                                                       "endpoint": jetstream_endpoint(MODEL, victim), "topic": "x"})
                assert resp.status_code in (400, 409), resp.text
                bucket.put(RegisterWorker(worker_id=f"thief{rounds}", endpoint=jetstream_endpoint(MODEL, victim),
                                          block_size=BS))
                thefts += 1
                subject = event_subject(MODEL, victim)  # junk without kvatlas headers on its subject
                nt.call(lambda: nt.js.publish(subject, b"\xc1 not a batch"))
            if rounds % 15 == 0 and len(slow) < 200:  # slowloris: partial headers, never finished
                slow += slowloris(r.port, 20)
            time.sleep(0.01)  # pacing the producers, not a synchronisation
        pubs["big"] = big_pub
        pubs.update(hyb_pubs)
        for p in pubs.values():
            p.heartbeat()  # the last message on each subject is its own (not the thief's junk)
            assert p.flush(20.0)
        assert q_pub.flush(20.0)
        marks = {w: subject_last_seq(p) for w, p in pubs.items()}
        marks["q0"] = q_pub.next_seq - 1
        marks["u0"] = u_pub.last_seq
        target_z = engine.seq - 1
        wait_until(lambda: engine.relay.sub.watermark("z0") == target_z and engine.relay.flush(5.0),
                   timeout=30.0, interval=0.05)
        with engine.lock:
            marks["z0"] = subject_last_seq(engine.relay.pubs["z0"])

        wait_applied(r.client, marks, q_pub.heartbeat, timeout=60.0)
        scorer.stop()
        probe.stop()
        # Honest answers exact; the relayed u64 engine's chain whole.
        queries = [q for s in honest.values() for q in s.sample_queries(8)]
        others = {w: WorkerSim(0, BS, []) for w in ("big", "z0", "u0")}  # hold none of the honest prompts
        assert check_scores(r.client, {**honest, **others}, queries) == len(queries)
        rows = {x["worker_id"]: x for x in r.client.get("/workers").json()["workers"]}
        assert set(rows) == set(honest) | {"z0", "big", "u0", "flood", "hh"}, sorted(rows)  # no thief ever registered
        b = {x["worker_id"]: x for x in r.client.post("/score", json={"token_ids": big_chain}).json()["workers"]}
        assert b["big"]["device_blocks"] == b["q0"]["device_blocks"] == len(big_chain) // BS, (b["big"], b["q0"])
        z = r.client.post("/score", json={"token_ids": z_chain}).json()
        for zrow in (x for x in z["workers"] if x["worker_id"] in ("z0", "u0")):
            assert zrow["device_blocks"] == len(z_chain) // BS, zrow
        for w in [*honest, "big"]:
            assert rows[w]["exact"] is True and rows[w]["gaps"] == 0, rows[w]
        assert rows["z0"]["gaps"] == rows["u0"]["gaps"] == 1  # the opening one, before their first block
        # The honest hybrid worker beside the group flood is exact; the flood's chain is its own.
        check_hybrid_beside_flood(r.client, hh_prompt, scorer)
        assert rows["hh"]["exact"] is True and rows["hh"]["gaps"] == 0, rows["hh"]
        metrics = r.client.get("/metrics").text
        assert 'kvatlas_shared_registry_errors_total{op="apply_put"}' in metrics
        check_soak_end("nats", metrics, flood, GROUP_CAP, slow, probe, scorer, r.proc.pid, rss0,
                       100.0 if LONG else None, rounds, thefts)
    finally:
        stop_parties(scorer, probe, slow)
        engine.close()
        q_pub.close()
        u_pub.close()
        for p in {**pubs, **hyb_pubs}.values():
            p.close()
        bucket.close()
        nt.close()
        r.terminate()
