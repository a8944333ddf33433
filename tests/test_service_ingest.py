"""Live ingestion through real ZMQ sockets into a real uvicorn-served indexer: 8 publishers checked
against the brute-force reference model and the simulated caches; lost batches replayed; losses
beyond the replay buffer resynced and reported; publisher restarts; bad input counted; silent
workers marked stale and then removed."""
from __future__ import annotations

import random
from typing import Any, Callable, Iterator

import httpx
import pytest

from support.net import free_port, wait_until
from indexer.subscriber import Subscriber
from producer.publisher import ZmqEventPublisher
from router_api.config import ServiceConfig
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from support.service import LiveIndexer, WorkerSim, check_scores, make_prompts
from support.fleet import BS, Fleet


def _cfg(**kw: Any) -> ServiceConfig:
    kw.setdefault("stats_ttl_s", 0.0)
    return ServiceConfig(port=free_port(), block_size=BS, replay_timeout_s=1.0, **kw)


def _dropping_subscriber(drop: Callable[[str, int], bool]) -> Callable[[], Subscriber]:
    return lambda: Subscriber(replay_timeout=1.0, drop_live=drop)


def _metric(client: httpx.Client, prefix: str) -> float:
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(prefix):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def live() -> Iterator[LiveIndexer]:
    li = LiveIndexer(_cfg()).start()
    try:
        yield li
    finally:
        li.stop()


def test_eight_publishers_match_the_reference(live: LiveIndexer) -> None:
    fleet = Fleet(live.client, 8, seed=1)
    try:
        rng = random.Random(1)
        marks = fleet.run(120, rng)
        fleet.settle(marks)
        queries = [q for sim in fleet.sims.values() for q in sim.sample_queries(6)]
        fleet.check_reference(queries)
        assert check_scores(live.client, fleet.sims, queries) == 48
        rows = {w["worker_id"]: w for w in live.client.get("/workers").json()["workers"]}
        ref_stats = fleet.ref.worker_stats("default")
        for wid in fleet.sims:
            # A subscriber connecting after the first sends sees one gap, recovered by replay.
            assert rows[wid]["status"] == "live" and rows[wid]["resyncs"] == 0
            assert rows[wid]["gaps"] == rows[wid]["replays"] <= 1
            assert rows[wid]["blocks"] == ref_stats[(wid, 0)]
        # Some best worker is always the one the reference ranks first (ties broken the same way).
        q = fleet.sims["w3"].history[-1]
        best = live.client.post("/score", json={"token_ids": q}).json()["best"]
        top = fleet.ref.score("default", q).workers[0]
        assert best == {"worker_id": top.worker_id, "dp_rank": top.dp_rank}
    finally:
        fleet.close()


def test_lost_batches_are_replayed() -> None:
    lost: set[tuple[str, int]] = set()  # chosen once subscriptions are up: connect() heartbeats
    seen: set[tuple[str, int]] = set()   # for as long as the slow joiner takes, consuming seqs

    def drop(wid: str, seq: int) -> bool:
        if (wid, seq) in lost and (wid, seq) not in seen:
            seen.add((wid, seq))
            return True
        return False

    li = LiveIndexer(_cfg(), subscriber_factory=_dropping_subscriber(drop)).start()
    fleet = Fleet(li.client, 3, seed=2)
    try:
        base = fleet.connect()
        n0, n2 = fleet.pubs["w0"].next_seq, fleet.pubs["w2"].next_seq
        lost.update({("w0", n0 + s) for s in range(10, 15)} | {("w2", n2 + 30)})
        marks = fleet.run(60, random.Random(2))
        fleet.settle(marks)
        assert seen == lost  # the losses really happened on the live stream
        queries = [q for sim in fleet.sims.values() for q in sim.sample_queries(8)]
        fleet.check_reference(queries)
        check_scores(li.client, fleet.sims, queries)
        rows = {w["worker_id"]: w for w in li.client.get("/workers").json()["workers"]}
        def delta(wid: str) -> tuple[int, int, int]:
            return tuple(rows[wid][k] - base[wid][k] for k in ("gaps", "replays", "resyncs"))
        assert delta("w0") == (1, 1, 0) and delta("w2") == (1, 1, 0) and delta("w1") == (0, 0, 0)
        assert rows["w0"]["status"] == "live"
        assert _metric(li.client, "kvatlas_replays_total") == sum(r["replays"] for r in rows.values())
        assert _metric(li.client, 'kvatlas_batches_total{kind="replayed",worker="w0"}') == 5
    finally:
        fleet.close()
        li.stop()


def test_loss_beyond_the_replay_buffer_resyncs_and_is_reported() -> None:
    lost: set[int] = set()  # filled once the stream is up: the next 21 seqs of w0
    li = LiveIndexer(_cfg(resync_hold_s=60.0),
                     subscriber_factory=_dropping_subscriber(lambda w, s: w == "w0" and s in lost)).start()
    fleet = Fleet(li.client, 2, seed=3, buffer_steps=5)
    try:
        base = fleet.connect()
        marks = fleet.run(20, random.Random(3))
        fleet.settle(marks)
        lost.update(range(fleet.pubs["w0"].next_seq, fleet.pubs["w0"].next_seq + 21))
        before = fleet.sims["w0"].history[-1]
        assert li.client.post("/score", json={"token_ids": before}).json()["workers"][0]["cached_blocks"] > 0
        # 21 batches lost on the wire; the 5-batch buffer cannot cover them (its tail, heartbeats here,
        # is replayed, which keeps what the index rebuilds from exactly the fresh stores below).
        for _ in range(15):
            fleet.publish("w0", fleet.sims["w0"].step())
        for _ in range(6):
            fleet.pubs["w0"].heartbeat()
        # After the loss the worker stores fresh prefixes (no parent from before the gap).
        sim = fleet.sims["w0"]
        sim.clear()
        fresh = [[random.Random(s).randrange(1, 50_000) for _ in range(BS * 3)] for s in range(5)]
        last = 0
        for toks in fresh:
            last = fleet.publish("w0", sim.store(toks))
        fleet.pubs["w0"].flush(10)
        fleet.settle({"w0": last})
        rows = {w["worker_id"]: w for w in li.client.get("/workers").json()["workers"]}
        assert rows["w0"]["status"] == "resyncing"
        assert (rows["w0"]["gaps"] - base["w0"]["gaps"], rows["w0"]["resyncs"]) == (1, 1)
        assert rows["w0"]["replays"] == base["w0"]["replays"]
        assert rows["w1"]["status"] == "live" and rows["w1"]["resyncs"] == 0
        # Old blocks are gone (not pretended), what followed the gap is exact.
        body = li.client.post("/score", json={"token_ids": before}).json()
        assert {w["worker_id"]: w["cached_blocks"] for w in body["workers"]}["w0"] == 0
        for toks in fresh:
            w0 = {w["worker_id"]: w for w in li.client.post("/score", json={"token_ids": toks}).json()["workers"]}["w0"]
            assert w0["cached_blocks"] == 3 and w0["device_blocks"] == 3
        assert rows["w0"]["blocks"]["gpu"] == 15
        assert _metric(li.client, 'kvatlas_resyncs_total{worker="w0"}') == 1
        score_w0 = {w["worker_id"]: w for w in li.client.post("/score", json={"token_ids": fresh[0]}).json()["workers"]}["w0"]
        assert score_w0["status"] == "resyncing" and score_w0["stale"] is False
    finally:
        fleet.close()
        li.stop()


def test_publisher_restart_drops_old_blocks(live: LiveIndexer) -> None:
    fleet = Fleet(live.client, 2, seed=4)
    try:
        marks = fleet.run(40, random.Random(4))
        fleet.settle(marks)
        old_sim = fleet.sims["w0"]
        old_queries = [list(h) for h in old_sim.history[-5:]]
        assert any(old_sim.expect(q)["cached_blocks"] for q in old_queries)
        # The worker process restarts: same endpoints, seq from 0, empty cache.
        ep, rep = fleet.endpoints["w0"]
        fleet.pubs["w0"].close()
        fleet.pubs["w0"] = ZmqEventPublisher(ep, replay_endpoint=rep)
        new_sim = fleet.sims["w0"] = WorkerSim(999, BS, make_prompts(40, BS))
        fleet.ref.clear_worker("default", "w0")
        last = 0
        for _ in range(10):
            last = fleet.publish("w0", new_sim.step())
        fleet.pubs["w0"].flush(10)
        def restarted() -> bool:
            fleet.pubs["w0"].heartbeat()  # the SUB reconnects on its own schedule; nudge until seen
            rows = {w["worker_id"]: w for w in live.client.get("/workers").json()["workers"]}
            return rows["w0"]["restarts"] == 1

        wait_until(restarted, timeout=10, interval=0.05)
        fleet.settle({"w0": last})
        for q in old_queries:
            w0 = {w["worker_id"]: w for w in live.client.post("/score", json={"token_ids": q}).json()["workers"]}["w0"]
            assert w0["cached_blocks"] == new_sim.expect(q)["cached_blocks"] == 0
        fleet.check_reference(new_sim.sample_queries(10) + old_queries)
        check_scores(live.client, fleet.sims, new_sim.sample_queries(10))
        assert _metric(live.client, 'kvatlas_restarts_detected_total{worker="w0"}') == 1
    finally:
        fleet.close()


def test_bad_input_is_counted_and_the_service_stays_up(live: LiveIndexer) -> None:
    fleet = Fleet(live.client, 1, seed=5)
    try:
        pub = fleet.pubs["w0"]
        good_before = fleet.sims["w0"].store([7] * (BS * 2))
        fleet.publish("w0", good_before)
        pub.publish_payload(b"\xc1 definitely not msgpack")
        pub.publish_payload(b"\x93\xcb")  # truncated msgpack
        pub.publish([BlockStored(block_hashes=[111], parent_block_hash=None, token_ids=[1] * BS, block_size=BS,
                                 medium="QUANTUM_FOAM")])
        pub.publish([BlockStored(block_hashes=[222, 223], parent_block_hash=None, token_ids=[2] * 16,
                                 block_size=8)])
        pub.publish([BlockRemoved(block_hashes=[424242], medium="GPU")])
        good = fleet.sims["w0"].store([9] * (BS * 3))
        last = fleet.publish("w0", good)
        pub.flush(10)
        fleet.settle({"w0": last})
        text = live.client.get("/metrics").text
        for reason in ("decode_malformed", "unknown_medium", "block_size_mismatch"):
            assert _metric(live.client, f'kvatlas_drops_total{{reason="{reason}"}}') >= 1, (reason, text)
        assert _metric(live.client, 'kvatlas_events_applied_total{outcome="absent",tier="GPU",type="removed"}') == 1
        drops = live.client.get("/stats").json()["drops"]
        assert drops["decode_malformed"] == 2 and drops["unknown_medium"] >= 1 and drops["block_size_mismatch"] >= 1
        # Good batches around the bad ones applied; nothing from the bad ones leaked in.
        body = live.client.post("/score", json={"token_ids": [9] * (BS * 3)}).json()
        assert body["workers"][0]["device_blocks"] == 3
        assert live.client.post("/score", json={"token_ids": [1] * BS}).json()["workers"][0]["cached_blocks"] == 0
        assert live.client.post("/score", json={"token_ids": [2] * 8}).json()["workers"][0]["cached_blocks"] == 0
        fleet.check_reference([[7] * (BS * 2), [9] * (BS * 3)])
        core = "native" if live.service.index.native else "python"
        # the service stays up, and says which worker's events it dropped
        assert live.client.get("/health").json() | {"uptime_s": 0} == {
            "status": "degraded", "workers": 1, "ingest_alive": True, "uptime_s": 0, "models": {"default": BS},
            "core": core, "degraded_workers": {"w0": ["dropping"]}}
        w0 = live.client.get("/workers/w0").json()
        assert w0["dropping"] and w0["drops"]["decode_malformed"] == 2 and w0["drops"]["block_size_mismatch"] == 2
        assert fleet.pubs["w0"] and AllBlocksCleared  # imported types used above
    finally:
        fleet.close()


def test_silent_worker_goes_stale_then_is_removed() -> None:
    li = LiveIndexer(_cfg(stale_after_s=0.4, remove_after_s=1.5, silent_engine_factor=1.0)).start()
    fleet = Fleet(li.client, 2, seed=6)
    try:
        fleet.run(10, random.Random(6))
        marks = {}
        for wid, p in fleet.pubs.items():  # both prove they heartbeat (our producer does)
            marks[wid] = p.next_seq
            p.heartbeat()
        fleet.settle(marks)
        fleet.pubs["w0"].close()  # w0 dies; w1 keeps heartbeating

        def statuses() -> dict[str, str]:
            fleet.pubs["w1"].heartbeat()
            return {w["worker_id"]: w["status"] for w in li.client.get("/workers").json()["workers"]}

        wait_until(lambda: statuses().get("w0") == "stale", timeout=30, interval=0.05)
        assert statuses()["w1"] == "live"
        q = fleet.sims["w0"].history[-1]
        rows = {w["worker_id"]: w for w in li.client.post("/score", json={"token_ids": q}).json()["workers"]}
        assert rows["w0"]["stale"] is True and rows["w1"]["stale"] is False
        wait_until(lambda: "w0" not in statuses(), timeout=30, interval=0.05)
        body = li.client.post("/score", json={"token_ids": q}).json()
        assert [w["worker_id"] for w in body["workers"]] == ["w1"]
        assert statuses()["w1"] == "live"
    finally:
        for wid, p in fleet.pubs.items():
            if wid != "w0":
                p.close()
        li.stop()


def test_fast_path_keeps_dp_rank_and_judges_events_like_the_full_decoder(live: LiveIndexer) -> None:
    """Ingest hands payloads to `apply_payload` after reading only their head: dp_rank still comes
    from the batch (a negative one falls back to the registered rank), an event the head skipped but
    that does not decode is dropped alone under the full decoder's label (`event_<reason>`), and array-form events
    (which the head does not read) still apply through the full decoder."""
    import msgspec

    fleet = Fleet(live.client, 1, seed=8)
    try:
        pub = fleet.pubs["w0"]
        c = live.client
        before = live.client.get("/stats").json()["drops"].get("event_invalid", 0)
        rank3 = [9] * (BS * 2)
        pub.publish([BlockStored(block_hashes=[31, 32], parent_block_hash=None, token_ids=rank3, block_size=BS)],
                    dp_rank=3)
        neg = [8] * BS
        pub.publish_payload(msgspec.msgpack.encode(
            [1.0, [{"type": "BlockStored", "block_hashes": [41], "parent_block_hash": None, "token_ids": neg,
                    "block_size": BS}], -1]))
        pub.publish_payload(msgspec.msgpack.encode(  # tags fine, token ids are not ints
            [1.0, [{"type": "BlockStored", "block_hashes": [51], "parent_block_hash": None,
                    "token_ids": ["x"] * BS, "block_size": BS}], None]))
        arr = [6] * BS
        pub.publish_payload(msgspec.msgpack.encode(  # Dynamo-style positional event
            [1.0, [["BlockStored", [61], None, arr, BS, None, "GPU"]], None]))
        pub.heartbeat()
        pub.flush(10)
        fleet.settle({"w0": pub.next_seq - 1})
        row = {w["worker_id"]: w for w in c.get("/workers").json()["workers"]}["w0"]
        assert row["dp_ranks"] == [0, 3]
        by_rank = {w["dp_rank"]: w for w in c.post("/score", json={"token_ids": rank3}).json()["workers"]}
        assert by_rank[3]["device_blocks"] == 2 and by_rank[0]["device_blocks"] == 0
        by_rank = {w["dp_rank"]: w for w in c.post("/score", json={"token_ids": neg}).json()["workers"]}
        assert by_rank[0]["device_blocks"] == 1 and by_rank[3]["device_blocks"] == 0
        assert c.post("/score", json={"token_ids": arr}).json()["workers"][0]["device_blocks"] == 1
        assert c.get("/stats").json()["drops"]["event_invalid"] == before + 1
        assert _metric(c, 'kvatlas_events_applied_total{outcome="new",tier="GPU",type="stored"}') >= 4
        assert _metric(c, 'kvatlas_batches_total{kind="heartbeat",worker="w0"}') >= 1
    finally:
        fleet.close()
