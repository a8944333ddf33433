"""Hostile publishers beside honest ones on the ZeroMQ path (issue 24; docs/limits.md): one
`kvatlas indexer` reading honest ZeroMQ workers (with replay endpoints) and, beside them, a hybrid
group flood (10,000 single-block sliding-window groups and a 30,000-block chain, the chain scored at
480k tokens in a loop meanwhile), a worker storing batches over 1 MiB, a raw publisher counting from
seq 2^63, a thief registering the honest workers' endpoints, and slowloris clients holding the HTTP
port. After quiescence every honest worker's answers are exact (the honest hybrid worker's too), the
hostile parties are refused or counted, /health kept answering, the indexer's RSS stayed bounded.

Short by default (inside `make test`: exactness, and /health answered); `KVATLAS_SOAK_S=60` runs
longer, and then also holds /health p99 under 100 ms. Loopback only. The NATS twin:
test_soak_hostile_nats.py."""
from __future__ import annotations

import os
import random
import time
from pathlib import Path


from indexer.core.groups import GROUP_CAP
from producer.publisher import ZmqEventPublisher
from schemas.events import BlockStored
from support.hostile import (FLOOD_BS, HighSeqPublisher, start_flood, wait_applied, stop_parties, check_hybrid_beside_flood, check_soak_end, GroupFlood, honest_hybrid,
                             rss_kb, slowloris)
from support.net import free_port, wait_until
from support.service import KVIndexerProcess, WorkerSim, check_scores, make_prompts

BS = 4
SOAK_S = float(os.environ.get("KVATLAS_SOAK_S", "5"))
LONG = SOAK_S >= 30


def _pub() -> ZmqEventPublisher:
    return ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")


def test_hostile_publishers_beside_honest_ones_on_zmq(tmp_path: Path) -> None:
    r = KVIndexerProcess(free_port(), "--block-size", str(BS), "--http-request-timeout", "2",
                         log_path=tmp_path / "indexer.log")
    r.wait_ready()
    honest = {f"h{i}": WorkerSim(i, BS, make_prompts(100 + i, BS)) for i in range(3)}
    pubs = {w: _pub() for w in (*honest, "big", "flood", "hh")}
    u_pub = HighSeqPublisher()  # honest content, seqs from 2^63 + 7
    rng = random.Random(7)
    flood = GroupFlood(11)
    hh_events, hh_prompt = honest_hybrid(12)
    slow: list = []
    probe = scorer = None
    try:
        for w, p in pubs.items():
            hybrid = w in ("flood", "hh")
            body = {"worker_id": w, "endpoint": p.endpoint, "replay_endpoint": p.replay_endpoint,
                    "block_size": FLOOD_BS if hybrid else BS, **({"model": "hyb"} if hybrid else {})}
            assert r.client.post("/workers", json=body).status_code == 201, w
        assert r.client.post("/workers", json={"worker_id": "u0", "endpoint": u_pub.endpoint,
                                               "block_size": BS}).status_code == 201

        def joined() -> bool:  # ZeroMQ slow joiner: heartbeats until every worker's first seq is in
            for p in pubs.values():
                p.heartbeat()
            u_pub.send([])
            rows = r.client.get("/workers").json()["workers"]
            return len(rows) == len(pubs) + 1 and all(x["last_seq"] is not None for x in rows)
        wait_until(joined, timeout=30.0, interval=0.05)
        rss0 = rss_kb(r.proc.pid)
        probe, scorer = start_flood(r.url, pubs["hh"], pubs["flood"], hh_events, flood)
        big_chain: list[int] = []
        big_parent: int | None = None
        parent_z: int | None = None
        z_chain: list[int] = []
        end = time.monotonic() + SOAK_S
        rounds = thefts = 0
        while time.monotonic() < end:
            rounds += 1
            for w, sim in honest.items():
                pubs[w].publish(sim.step())
            if rounds % 2 == 1:
                pubs["flood"].publish(flood.groups())
            if rounds % 50 == 1 and len(big_chain) < 2 * 40_000 * BS:  # batches over 1 MiB
                big = BlockStored([rng.randrange(1, 1 << 62) for _ in range(40_000)], big_parent,
                                  [rng.randrange(1 << 20, 1 << 30) for _ in range(40_000 * BS)], BS)
                big_parent = big.block_hashes[-1]
                big_chain.extend(big.token_ids)
                pubs["big"].publish([big])
            ev = BlockStored([rng.randrange(1, 1 << 62)], parent_z, [rng.randrange(1, 1 << 30) for _ in range(BS)], BS)
            parent_z = ev.block_hashes[0]
            z_chain.extend(ev.token_ids)
            u_pub.send([ev])
            if rounds % 10 == 0:  # the thief: an honest worker's endpoint under another id
                victim = rng.choice(list(honest))
                resp = r.client.post("/workers", json={"worker_id": f"thief{rounds}", "block_size": BS,
                                                       "endpoint": pubs[victim].endpoint})
                assert resp.status_code == 409, resp.text  # one publisher, one worker
                thefts += 1
            if rounds % 15 == 0 and len(slow) < 200:
                slow += slowloris(r.port, 20)
            time.sleep(0.01)  # pacing the producers, not a synchronisation
        for p in pubs.values():
            assert p.flush(30.0)
        marks = {w: p.next_seq - 1 for w, p in pubs.items()}
        marks["u0"] = u_pub.last_seq

        def nudge() -> None:
            for p in pubs.values():
                p.heartbeat()
            marks.update({w: p.next_seq - 1 for w, p in pubs.items()})
        wait_applied(r.client, marks, nudge, timeout=90.0)
        scorer.stop()
        probe.stop()
        # Honest answers exact, on the default model and on the hybrid one beside the flood.
        queries = [q for s in honest.values() for q in s.sample_queries(8)]
        others = {w: WorkerSim(0, BS, []) for w in ("big", "u0")}  # hold none of the honest prompts
        assert check_scores(r.client, {**honest, **others}, queries) == len(queries)
        rows = {x["worker_id"]: x for x in r.client.get("/workers").json()["workers"]}
        assert set(rows) == set(pubs) | {"u0"}, sorted(rows)  # no thief ever registered
        b = {x["worker_id"]: x for x in r.client.post("/score", json={"token_ids": big_chain}).json()["workers"]}
        assert b["big"]["device_blocks"] == len(big_chain) // BS, b["big"]
        z = {x["worker_id"]: x for x in r.client.post("/score", json={"token_ids": z_chain}).json()["workers"]}
        assert z["u0"]["device_blocks"] == len(z_chain) // BS, z["u0"]
        check_hybrid_beside_flood(r.client, hh_prompt, scorer)
        for w in [*honest, "big", "hh"]:
            assert rows[w]["exact"] is True and rows[w]["gaps"] == 0, rows[w]
        assert rows["u0"]["gaps"] == 1  # the opening one, before its first block
        metrics = r.client.get("/metrics").text
        check_soak_end("zmq", metrics, flood, GROUP_CAP, slow, probe, scorer, r.proc.pid, rss0,
                       100.0 if LONG else None, rounds, thefts)
    finally:
        stop_parties(scorer, probe, slow)
        for p in pubs.values():
            p.close()
        u_pub.close()
        r.terminate()
