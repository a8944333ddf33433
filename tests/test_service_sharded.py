"""Ingest shards (`--ingest-shards N`): N ingest pipelines over an `indexer.sharded.ShardedIndex`, each
with its own thread, subscriber and lock (router_api/ingest.py `IngestSet`, router_api/locks.py).
Through real ZeroMQ publishers and a real uvicorn-served indexer: the same streams give the same
answers as one pipeline; a restart or an unrecoverable gap clears only its worker; registrations come
and go while both pipelines apply, without deadlock, and leave the registry and the index agreeing;
the liveness tick (pipeline 0) expires a worker of another pipeline; bad settings are refused."""
from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from support.net import free_port, wait_until
from indexer.index import KVIndex
from indexer.sharded import ShardedIndex
from indexer.subscriber import Subscriber
from producer.publisher import ZmqEventPublisher
from cli import indexer as cmd_indexer
from cli.main import build_parser
from router_api.ingest import IngestLoop, IngestSet
from router_api.locks import ShardedLock
from router_api.config import ServiceConfig
from router_api.service import IndexerService
from schemas.api import RegisterWorker
from support.fleet import BS, Fleet
from support.service import LiveIndexer, WorkerSim, check_scores, make_prompts, wait_applied

MODEL = "default"


def _cfg(shards: int, **kw: Any) -> ServiceConfig:
    kw.setdefault("stats_ttl_s", 0.0)
    return ServiceConfig(port=free_port(), block_size=BS, replay_timeout_s=1.0, ingest_shards=shards, **kw)


def _shards_of(svc: IndexerService, wids: Any) -> dict[str, int]:
    return {wid: svc.index.shard_of(wid) for wid in wids}  # type: ignore[attr-defined]


def _rows(li: LiveIndexer) -> dict[str, dict[str, Any]]:
    return {w["worker_id"]: w for w in li.client.get("/workers").json()["workers"]}


def _score_rows(li: LiveIndexer, q: list[int]) -> dict[str, dict[str, Any]]:
    r = li.client.post("/score", json={"token_ids": q})
    assert r.status_code == 200, r.text
    return {w["worker_id"]: w for w in r.json()["workers"]}


def _subscribed(loop: IngestLoop) -> list[str] | None:
    """The workers a pipeline's subscriber reads (None if its thread changed them as we looked)."""
    try:
        return sorted(loop._sub.workers()) if loop._sub is not None else []
    except RuntimeError:  # dictionary changed size during iteration
        return None


def _index_agrees_with_registry(svc: IndexerService) -> None:
    """Every registered worker is in the index, in its own shard only, and nothing else is."""
    ids = {w.worker_id for w in svc.registry}
    assert {wid for wid, _rank in svc.index.workers(MODEL)} == ids
    for i, shard in enumerate(svc.index.shards):  # type: ignore[attr-defined]
        assert {wid for wid, _rank in shard.workers(MODEL)} == {w for w in ids if svc.index.shard_of(w) == i}


# --- 1. the same streams, the same answers --------------------------------------------------------

def test_two_pipelines_answer_like_one() -> None:
    """Six publishers feed a 2-pipeline and a 1-pipeline indexer at once (a PUB fans out to both)."""
    two = LiveIndexer(_cfg(2)).start()
    one = LiveIndexer(_cfg(1)).start()
    fleet = Fleet(two.client, 6, seed=11)
    try:
        placed = _shards_of(two.service, fleet.pubs)
        assert set(placed.values()) == {0, 1}, placed  # both pipelines have workers
        loops = two.service.ingest.loops  # type: ignore[union-attr]
        for wid, (ep, rep) in fleet.endpoints.items():
            r = one.client.post("/workers", json={"worker_id": wid, "endpoint": ep, "replay_endpoint": rep,
                                                   "block_size": BS})
            assert r.status_code == 201, r.text
            # Subscribed by its own pipeline only.
            assert [wid in (_subscribed(loop) or ()) for loop in loops] == [i == placed[wid] for i in range(2)]
        fleet.connect()
        marks = fleet.run(80, random.Random(11))
        fleet.settle(marks)
        wait_applied(one.client, marks, pubs=fleet.pubs)
        queries = [q for sim in fleet.sims.values() for q in sim.sample_queries(6)]
        fleet.check_reference(queries)  # the sharded one is exact
        assert check_scores(two.client, fleet.sims, queries) == 36
        a, b = two.service.index, one.service.index
        for q in queries:
            assert a.score(MODEL, q) == b.score(MODEL, q)
            got, want = _score_rows(two, q), _score_rows(one, q)  # the C answer writer over the shards
            for w in (*got.values(), *want.values()):
                del w["last_seq"], w["status"]  # heartbeats may still be in flight to one of them
            assert got == want
        assert a.worker_stats(MODEL) == b.worker_stats(MODEL) == fleet.ref.worker_stats(MODEL)
        assert sorted(a.workers(MODEL)) == sorted(b.workers(MODEL))
        assert {w: r["blocks"] for w, r in _rows(two).items()} == {w: r["blocks"] for w, r in _rows(one).items()}
        assert two.service.ingest.applied_batches == sum(loop.applied_batches for loop in loops) > 0
        assert all(loop.applied_batches > 0 for loop in loops)  # both pipelines did apply
        _index_agrees_with_registry(two.service)
    finally:
        fleet.close()
        one.stop()
        two.stop()


# --- 2. a gap, a restart: only that worker -----------------------------------------------------------

def test_restart_and_lost_gap_clear_only_their_worker() -> None:
    lost: set[tuple[str, int]] = set()
    li = LiveIndexer(_cfg(2, resync_hold_s=60.0),
                     subscriber_factory=lambda: Subscriber(replay_timeout=1.0,
                                                           drop_live=lambda w, s: (w, s) in lost)).start()
    fleet = Fleet(li.client, 6, seed=12, buffer_steps=5)
    try:
        placed = _shards_of(li.service, fleet.pubs)
        restarted = next(w for w, s in placed.items() if s == 0)
        gapped = next(w for w, s in placed.items() if s == 1)
        others = [w for w in fleet.pubs if w not in (restarted, gapped)]
        assert {placed[w] for w in others} == {0, 1}
        base = fleet.connect()
        fleet.settle(fleet.run(20, random.Random(12)))
        old = {w: [list(h) for h in fleet.sims[w].history[-4:]] for w in (restarted, gapped)}
        for w in (restarted, gapped):
            assert any(_score_rows(li, q)[w]["cached_blocks"] for q in old[w])

        # `gapped` loses 21 batches on the wire, more than its 5-batch replay buffer holds.
        pub = fleet.pubs[gapped]
        lost.update((gapped, pub.next_seq + k) for k in range(21))
        for _ in range(15):
            fleet.publish(gapped, fleet.sims[gapped].step())
        for _ in range(6):
            pub.heartbeat()
        sim = fleet.sims[gapped]
        sim.clear()  # what it stores after the loss names no parent from before it
        fresh = [[random.Random(s).randrange(1, 50_000) for _ in range(BS * 3)] for s in range(4)]
        for toks in fresh:
            last_gapped = fleet.publish(gapped, sim.store(toks))

        # `restarted` restarts: same endpoints, seq from 0, an empty cache.
        ep, rep = fleet.endpoints[restarted]
        fleet.pubs[restarted].close()
        fleet.pubs[restarted] = ZmqEventPublisher(ep, replay_endpoint=rep)
        new_sim = fleet.sims[restarted] = WorkerSim(998, BS, make_prompts(41, BS))
        fleet.ref.clear_worker(MODEL, restarted)
        for _ in range(8):
            last_restarted = fleet.publish(restarted, new_sim.step())

        def seen_restart() -> bool:
            fleet.pubs[restarted].heartbeat()  # the SUB reconnects on its own schedule
            return _rows(li)[restarted]["restarts"] == 1

        wait_until(seen_restart, timeout=10, interval=0.05)
        fleet.settle({gapped: last_gapped, restarted: last_restarted})
        rows = _rows(li)
        assert (rows[gapped]["gaps"] - base[gapped]["gaps"], rows[gapped]["resyncs"] - base[gapped]["resyncs"]) \
            == (1, 1)
        for w in others:  # untouched in either pipeline
            assert rows[w]["resyncs"] == base[w]["resyncs"] and rows[w]["restarts"] == 0, rows[w]
        for w in old:  # the old blocks are gone, not pretended
            assert all(_score_rows(li, q)[w]["cached_blocks"] == fleet.sims[w].expect(q)["cached_blocks"]
                       for q in old[w])
        for toks in fresh:
            assert _score_rows(li, toks)[gapped]["device_blocks"] == 3
        stats = li.service.index.worker_stats(MODEL)
        ref = fleet.ref.worker_stats(MODEL)
        assert {w: stats[(w, 0)] for w in others + [restarted]} == {w: ref[(w, 0)] for w in others + [restarted]}
        assert stats[(gapped, 0)]["gpu"] == 12
        queries = [q for w in others for q in fleet.sims[w].sample_queries(6)]
        for q in queries:
            got = _score_rows(li, q)
            for w in others:
                exp = fleet.sims[w].expect(q)
                assert (got[w]["device_blocks"], got[w]["cached_blocks"], got[w]["tiers"]) == (
                    exp["device_blocks"], exp["cached_blocks"], exp["tiers"]), (w, q)
    finally:
        fleet.close()
        li.stop()


# --- 3. registrations while both pipelines apply ----------------------------------------------------

def test_registrations_come_and_go_while_both_pipelines_apply() -> None:
    li = LiveIndexer(_cfg(2)).start()
    svc = li.service
    steady = Fleet(li.client, 4, seed=13, prefix="s")
    churn = Fleet(li.client, 4, seed=14, prefix="c")
    stop = threading.Event()
    errors: list[BaseException] = []
    marks: dict[str, int] = {}

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
        return run

    def publish() -> None:  # the only user of the steady fleet until it stops
        rng = random.Random(13)
        while not stop.is_set():
            wid = rng.choice(list(steady.sims))
            marks[wid] = steady.publish(wid, steady.sims[wid].step())

    regs = {wid: RegisterWorker(worker_id=wid, endpoint=ep, replay_endpoint=rep, block_size=BS)
            for wid, (ep, rep) in churn.endpoints.items()}
    rounds = 6

    def come_and_go() -> None:
        for _ in range(rounds):
            for wid, reg in regs.items():
                svc.unregister(wid)
                svc.score(MODEL, churn.sims[wid].request_tokens())
                svc.register(reg)  # waits for its pipeline to subscribe
                svc.workers()

    try:
        placed = _shards_of(svc, [*steady.pubs, *churn.pubs])
        assert {placed[w] for w in steady.pubs} == {0, 1} and {placed[w] for w in churn.pubs} == {0, 1}
        steady.connect()
        churn.connect()
        churn_marks = churn.run(15, random.Random(14))  # replayed from seq 0 on every re-registration
        churn.settle(churn_marks)
        publisher = threading.Thread(target=guarded(publish), name="test-publisher", daemon=True)
        churner = threading.Thread(target=guarded(come_and_go), name="test-churn", daemon=True)
        publisher.start()
        churner.start()
        queries = [q for sim in churn.sims.values() for q in sim.sample_queries(3)]
        deadline = time.monotonic() + 60
        while churner.is_alive() and time.monotonic() < deadline:  # HTTP meanwhile, each call bounded
            for q in queries:
                assert li.client.post("/score", json={"token_ids": q}).status_code == 200
            assert li.client.get("/health").json()["ingest_alive"] is True
        churner.join(5)
        assert not churner.is_alive(), "registration churn did not finish (deadlock?)"
        stop.set()
        publisher.join(30)
        assert not publisher.is_alive(), "publisher thread did not finish"
        assert not errors, errors
        loops = svc.ingest.loops  # type: ignore[union-attr]
        assert all(loop.applied_batches > 0 for loop in loops)
        steady.settle(dict(marks))
        churn.settle(churn_marks)
        assert {w.worker_id for w in svc.registry} == set(steady.pubs) | set(churn.pubs)
        _index_agrees_with_registry(svc)
        for i, loop in enumerate(loops):  # each pipeline subscribes exactly its workers
            assert _subscribed(loop) == sorted(w for w, s in placed.items() if s == i)
        sims = {**steady.sims, **churn.sims}
        check_scores(li.client, sims, [q for sim in sims.values() for q in sim.sample_queries(4)])
        rows = _rows(li)
        ref = {**steady.ref.worker_stats(MODEL), **churn.ref.worker_stats(MODEL)}
        assert {w: r["blocks"] for w, r in rows.items()} == {w: ref[(w, 0)] for w in rows}
    finally:
        stop.set()
        steady.close()
        churn.close()
        li.stop()


# --- the tick (pipeline 0) covers every pipeline's workers ------------------------------------------

def test_the_tick_expires_a_silent_worker_of_the_other_pipeline() -> None:
    li = LiveIndexer(_cfg(2, stale_after_s=0.4, remove_after_s=1.5, silent_engine_factor=1.0)).start()
    fleet = Fleet(li.client, 4, seed=15)
    try:
        placed = _shards_of(li.service, fleet.pubs)
        dead = next(w for w, s in placed.items() if s == 1)
        alive = [w for w in fleet.pubs if w != dead]
        fleet.run(5, random.Random(15))
        beats = {}
        for wid, p in fleet.pubs.items():  # all prove they heartbeat
            beats[wid] = p.next_seq
            p.heartbeat()
        fleet.settle(beats)
        fleet.pubs[dead].close()

        def statuses() -> dict[str, str]:
            for w in alive:
                fleet.pubs[w].heartbeat()
            return {w["worker_id"]: w["status"] for w in li.client.get("/workers").json()["workers"]}

        wait_until(lambda: statuses().get(dead) == "stale", timeout=30, interval=0.05)
        wait_until(lambda: dead not in statuses(), timeout=30, interval=0.05)
        assert set(statuses()) == set(alive) and set(statuses().values()) == {"live"}
        _index_agrees_with_registry(li.service)
        loop = li.service.ingest.loop_of(dead)  # type: ignore[union-attr]
        def unsubscribed() -> bool:  # by its own pipeline, on the tick's unregister
            workers = _subscribed(loop)
            return workers is not None and dead not in workers

        wait_until(unsubscribed, timeout=30)
    finally:
        for w, p in fleet.pubs.items():
            p.close()
        li.stop()


# --- 4. settings refused ----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1, 65, True, 2.0, "2", None])
def test_bad_ingest_shards_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="ingest_shards must be an integer from 1 to 64"):
        ServiceConfig(ingest_shards=bad)


def test_sharding_with_trusted_engine_hashes_is_refused() -> None:
    with pytest.raises(ValueError, match="ingest_shards=2 cannot be combined with trust_engine_hashes"):
        ServiceConfig(ingest_shards=2, trust_engine_hashes=True)
    ServiceConfig(ingest_shards=1, trust_engine_hashes=True)  # one pipeline is one index: fine
    cfg = ServiceConfig(ingest_shards=2)
    cfg.trust_engine_hashes = True  # fields set after construction are checked again by the service
    with pytest.raises(ValueError, match="trust_engine_hashes"):
        IndexerService(cfg)


def test_the_index_must_have_the_configured_shards() -> None:
    with pytest.raises(ValueError, match="needs an index of 2 worker shards"):
        IndexerService(ServiceConfig(ingest_shards=2), index=KVIndex())
    with pytest.raises(ValueError, match="needs an index of 3 worker shards"):
        IndexerService(ServiceConfig(ingest_shards=3), index=ShardedIndex(2))
    svc = IndexerService(ServiceConfig(ingest_shards=3), index=ShardedIndex(3))
    assert len(svc.ingest.loops) == 3  # type: ignore[union-attr]


def _indexer_args(*argv: str) -> Any:
    return build_parser().parse_args(["indexer", *argv])


def test_cli_ingest_shards_default_is_auto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """No flag: one pipeline per usable CPU, capped; 1 where shards are refused; an explicit value wins."""
    monkeypatch.setattr(cmd_indexer, "usable_cpus", lambda: 2)
    with caplog.at_level("INFO", logger="kvatlas.indexer"):
        cmd_indexer.build_config(_indexer_args())
    assert "event=ingest_shards n=2 source=auto_cpus cpus=2" in caplog.text  # the choice is logged
    for cpus, want in ((1, 1), (2, 2), (6, 6), (64, cmd_indexer.AUTO_SHARDS_CAP)):
        monkeypatch.setattr(cmd_indexer, "usable_cpus", lambda cpus=cpus: cpus)
        assert cmd_indexer.build_config(_indexer_args()).ingest_shards == want
        assert cmd_indexer.build_config(_indexer_args("--ingest-shards", "auto")).ingest_shards == want
        assert cmd_indexer.build_config(_indexer_args("--ingest-shards", "1")).ingest_shards == 1
        assert cmd_indexer.build_config(_indexer_args("--ingest-shards", "3")).ingest_shards == 3
        nats = ("--nats", f"nats://127.0.0.1:{free_port()}")
        assert cmd_indexer.build_config(_indexer_args(*nats)).ingest_shards == 1
    conf = tmp_path / "indexer.json"
    conf.write_text(json.dumps({"ingest_shards": "auto"}))
    assert cmd_indexer.build_config(_indexer_args("--config", str(conf))).ingest_shards == cmd_indexer.AUTO_SHARDS_CAP
    assert cmd_indexer.resolve_ingest_shards("auto", nats=False, trust_engine_hashes=True, cpus=4) == (1, "auto_trust")
    assert cmd_indexer.resolve_ingest_shards("auto", nats=False, cpus=4) == (4, "auto_cpus")
    assert cmd_indexer.resolve_ingest_shards(2, nats=True, cpus=4) == (2, "flag")  # refused later, never overridden
    monkeypatch.undo()  # the real machine: its affinity mask, which a container's cpuset narrows
    assert 1 <= cmd_indexer.usable_cpus() <= (os.cpu_count() or 1)


def test_cli_ingest_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_indexer.build_config(_indexer_args("--ingest-shards", "3")).ingest_shards == 3
    conf = tmp_path / "indexer.json"
    conf.write_text(json.dumps({"ingest_shards": 2}))
    assert cmd_indexer.build_config(_indexer_args("--config", str(conf))).ingest_shards == 2
    assert cmd_indexer.build_config(_indexer_args("--config", str(conf), "--ingest-shards", "4")).ingest_shards == 4
    conf.write_text(json.dumps({"ingest_shards": True}))
    with pytest.raises(ValueError, match="ingest_shards"):
        cmd_indexer.build_config(_indexer_args("--config", str(conf)))
    with pytest.raises(SystemExit) as exc:
        _indexer_args("--ingest-shards", "two")
    assert exc.value.code == 2
    capsys.readouterr()
    for argv in (["--ingest-shards", "0"], ["--ingest-shards", "65"], ["--config", str(conf)]):
        assert cmd_indexer.run(_indexer_args(*argv)) == 2  # refused before anything starts
        assert "bad configuration: ingest_shards must be an integer from 1 to 64" in capsys.readouterr().err
    # Checked before connecting anywhere (the port is closed).
    assert cmd_indexer.run(_indexer_args("--ingest-shards", "2", "--nats", f"nats://127.0.0.1:{free_port()}")) == 2
    assert "--ingest-shards > 1 cannot be combined with --nats" in capsys.readouterr().err


def test_cli_help_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _indexer_args("--help")
    assert "--ingest-shards N" in capsys.readouterr().out


# --- 5. the default path and the sharded shape ------------------------------------------------------

def test_one_shard_keeps_the_single_loop_and_lock() -> None:
    svc = IndexerService(ServiceConfig())
    assert type(svc.ingest) is IngestLoop and type(svc.index) is KVIndex
    assert type(svc.lock) is type(threading.Lock())
    assert svc.ingest.lock is svc.ingest.global_lock is svc.lock and svc.ingest._ticks
    svc.start()
    try:
        assert svc.ingest.thread.name == "kvatlas-ingest" and svc.stats()["ingest_shards"] == 1
        assert svc.ingest.owns(svc.ingest.thread) and not svc.ingest.owns(threading.current_thread())
    finally:
        svc.stop(final_snapshot=False)


def test_sharded_service_shape() -> None:
    svc = IndexerService(ServiceConfig(ingest_shards=2, tier_weights={"gpu": 1.0, "host": 0.5}))
    ingest = svc.ingest
    assert isinstance(ingest, IngestSet) and isinstance(svc.lock, ShardedLock) and isinstance(svc.index, ShardedIndex)
    assert [loop.lock for loop in ingest.loops] == [svc.lock.shard(0), svc.lock.shard(1)]
    assert all(loop.global_lock is svc.lock for loop in ingest.loops)
    assert [loop._ticks for loop in ingest.loops] == [True, False]  # one policy tick per service
    assert not ingest.alive and ingest.deliveries == ingest.applied_batches == 0 and ingest.last_error is None
    svc.start()
    try:
        assert ingest.alive and svc.health().ingest_alive
        assert svc.stats()["ingest_shards"] == 2  # /stats reports the pipelines in use (the CLI's auto resolved)
        assert [t.name for t in ingest.threads] == ["kvatlas-ingest-0", "kvatlas-ingest-1"]
        assert all(ingest.owns(t) for t in ingest.threads) and not ingest.owns(threading.current_thread())
    finally:
        svc.stop(final_snapshot=False)
    assert not ingest.alive


def test_sharded_lock() -> None:
    lock = ShardedLock(3)
    assert len(lock) == 3 and not lock.locked()
    with lock:
        assert all(lock.shard(i).locked() for i in range(3))
    assert not lock.locked()
    held = lock.shard(1)
    assert held.acquire()
    try:
        assert lock.shard(0).acquire(False) and lock.shard(2).acquire(False)  # shards are independent
        lock.shard(0).release()
        lock.shard(2).release()
        assert lock.locked()
        assert not lock.acquire(timeout=0.01) and not lock.acquire(False)
        assert not lock.shard(0).locked() and not lock.shard(2).locked()  # nothing left half-held
    finally:
        held.release()
    assert lock.acquire(timeout=1)
    lock.release()
    assert not lock.locked()
    for bad in (0, 65, True):
        with pytest.raises(ValueError):
            ShardedLock(bad)


@pytest.mark.parametrize("busy_shard", [0, 1, 2])
def test_whole_lock_never_holds_a_shard_while_waiting_for_another(busy_shard: int) -> None:
    """A /score (the whole lock) that waits for a busy pipeline's shard must not sit on the other
    shards meanwhile: that stalled every pipeline behind one chunk (docs/service.md, "Ingest shards").
    Each shard busy in turn: the uncontended fast path gives up at shard 1 or 2, or waits at 0."""
    lock = ShardedLock(3)
    busy = lock.shard(busy_shard)
    busy.acquire()  # pipeline 1 in the middle of a chunk
    got = threading.Event()

    def whole() -> None:
        with lock:
            got.set()

    t = threading.Thread(target=whole, daemon=True)
    t.start()
    try:
        # the other pipelines keep getting their shards while the whole-lock taker waits
        for _ in range(50):
            for i in {0, 1, 2} - {busy_shard}:
                assert lock.shard(i).acquire(timeout=30.0), f"shard {i} held by a waiter"
                lock.shard(i).release()
        assert not got.is_set()
    finally:
        busy.release()
    t.join(5.0)
    assert got.is_set() and not lock.locked()
