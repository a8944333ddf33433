"""Worker lifecycle at the indexer: a worker's HTTP `url` in its registration and `GET /workers`;
`GET /workers/{id}`; block-size conflicts refused with 409 on every registration path; a worker
whose events are dropped named in its status, `/health`, `kvatlas_worker_drops_total` and one
WARNING; `kvatlas worker`'s registration kept across an indexer restart (sim/registrar.py),
with real processes."""
from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.publisher import ZmqEventPublisher
from sim.registrar import Registrar, RegistrationRefused
from router_api.config import ServiceConfig, default_index
from router_api.ingest import DROP_WARN_INTERVAL_S, IngestLoop
from router_api.metrics import ServiceMetrics
from router_api.registry import Registry, RegisteredWorker
from schemas.api import DROPPING_WINDOW_S, RegisterWorker
from router_api.procs import spawn, stop
from schemas.events import BlockStored
from support.net import free_port, wait_until
from support.service import REPO, KVIndexerProcess, LiveIndexer

BS = 16


def _publisher() -> ZmqEventPublisher:
    return ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")


def _metric(text: str, series: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


def test_url_is_registered_listed_and_validated() -> None:
    cfg = ServiceConfig(port=free_port(), block_size=BS)
    with LiveIndexer(cfg) as idx:
        c = idx.client
        ok = c.post("/workers", json={"worker_id": "a", "endpoint": f"tcp://127.0.0.1:{free_port()}",
                                      "url": "http://127.0.0.1:8100"})
        assert ok.status_code == 201 and ok.json()["url"] == "http://127.0.0.1:8100"
        # optional: a registration without one (an engine registered before urls existed) still works
        assert c.post("/workers", json={"worker_id": "b", "endpoint": f"tcp://127.0.0.1:{free_port()}"}).status_code == 201
        bad = c.post("/workers", json={"worker_id": "c", "endpoint": f"tcp://127.0.0.1:{free_port()}",
                                       "url": "tcp://127.0.0.1:1"})
        assert bad.status_code == 400 and "invalid url" in bad.json()["error"]
        rows = {w["worker_id"]: w for w in c.get("/workers").json()["workers"]}
        assert rows["a"]["url"] == "http://127.0.0.1:8100" and rows["b"]["url"] is None and "c" not in rows
        one = c.get("/workers/a")
        assert one.status_code == 200 and one.json()["url"] == "http://127.0.0.1:8100"
        assert c.get("/workers/nobody").status_code == 404


def test_block_size_conflicts_are_409_on_every_http_path() -> None:
    cfg = ServiceConfig(port=free_port(), block_size=BS)
    with LiveIndexer(cfg) as idx:
        c = idx.client

        def reg(wid: str, **kw: object) -> httpx.Response:
            return c.post("/workers", json={"worker_id": wid, "endpoint": f"tcp://127.0.0.1:{free_port()}", **kw})

        # the indexer's own model: its --block-size
        r = reg("x", block_size=32)
        assert r.status_code == 409 and r.json()["error"] == "block_size 32 conflicts with model 'default', which uses 16"
        # another model: fixed by its first worker, for every later one (the hand-registered vLLM path)
        assert reg("v1", model="m", block_size=32).status_code == 201
        r = reg("v2", model="m")  # block_size left out: 16
        assert r.status_code == 409 and "conflicts with model 'm', which uses 32" in r.json()["error"]
        # and the registration a `kvatlas worker` makes
        body = {"worker_id": "v3", "endpoint": f"tcp://127.0.0.1:{free_port()}", "model": "m", "block_size": 8}
        with pytest.raises(RegistrationRefused) as exc:
            Registrar(idx.url, body).register(timeout=5)
        assert exc.value.status == 409
        assert sorted(w["worker_id"] for w in c.get("/workers").json()["workers"]) == ["v1"]


def test_registrar_registers_again_when_the_indexer_forgets() -> None:
    cfg = ServiceConfig(port=free_port(), block_size=BS)
    body = {"worker_id": "w0", "endpoint": f"tcp://127.0.0.1:{free_port()}", "model": "default",
            "block_size": BS, "url": "http://127.0.0.1:9"}
    with LiveIndexer(cfg) as idx:
        r = Registrar(idx.url, body, interval_s=3600)
        r.register(timeout=5)
        assert r.check() == "registered"
        r.register(timeout=5)  # our own registration already there (a restored snapshot): fine
        assert idx.client.delete("/workers/w0").status_code == 200  # forgotten (as by a restart without snapshot)
        assert r.check() == "reregistered" and r.reregistrations == 1
        assert idx.client.get("/workers/w0").json()["url"] == "http://127.0.0.1:9"
        idx.client.delete("/workers/w0")
        other = {**body, "endpoint": f"tcp://127.0.0.1:{free_port()}"}
        assert idx.client.post("/workers", json=other).status_code == 201
        assert r.check() == "foreign"  # another process holds our id: named, not overwritten
        with pytest.raises(RegistrationRefused):
            r.register(timeout=5)
    assert r.check() == "unreachable"


def test_dropped_events_show_in_status_health_metrics_and_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A hand-registered worker whose engine uses another block size than it registered: every store
    is dropped. It says so in GET /workers, /health and /metrics, and one WARNING names it."""
    caplog.set_level(logging.WARNING, logger="kvatlas.ingest")
    cfg = ServiceConfig(port=free_port(), block_size=BS, stale_after_s=600, remove_after_s=3600)
    bad, good = _publisher(), _publisher()
    try:
        with LiveIndexer(cfg) as idx:
            c = idx.client
            for wid, pub in (("odd", bad), ("fine", good)):
                assert c.post("/workers", json={"worker_id": wid, "endpoint": pub.endpoint,
                                                "replay_endpoint": pub.replay_endpoint}).status_code == 201

            def live() -> bool:
                bad.heartbeat()
                good.heartbeat()
                return all(w["status"] == "live" for w in c.get("/workers").json()["workers"])
            wait_until(live, timeout=15)
            health = c.get("/health").json()
            assert health["status"] == "ok" and health["degraded_workers"] == {}
            for i in range(5):  # the engine's real block size is 32
                bad.publish([BlockStored(block_hashes=[1000 + 2 * i, 1001 + 2 * i], parent_block_hash=None,
                                         token_ids=[i] * 64, block_size=32)])
            good.publish([BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[7] * BS, block_size=BS)])
            wait_until(lambda: c.get("/workers/odd").json()["drops"].get("block_size_mismatch") == 10, timeout=15)
            wait_until(lambda: c.get("/workers/fine").json()["blocks"]["gpu"] == 1, timeout=15)
            odd, fine = c.get("/workers/odd").json(), c.get("/workers/fine").json()
            assert odd["dropping"] is True and odd["drops"] == {"block_size_mismatch": 10}
            assert fine["dropping"] is False and fine["drops"] == {}
            health = c.get("/health").json()
            assert health["status"] == "degraded" and health["degraded_workers"] == {"odd": ["dropping"]}
            text = c.get("/metrics").text
            assert _metric(text, 'kvatlas_worker_drops_total{reason="block_size_mismatch",worker="odd"}') == 10
            assert _metric(text, 'kvatlas_drops_total{reason="block_size_mismatch"}') == 10
            warnings = [r.getMessage() for r in caplog.records if "event=worker_dropping" in r.getMessage()]
            assert len(warnings) == 1 and "worker=odd " in warnings[0], warnings  # 5 batches, one line
            # forgotten with the worker: the series ends, the health line too
            assert c.delete("/workers/odd").status_code == 200
            assert 'worker="odd"' not in c.get("/metrics").text
            assert c.get("/health").json()["degraded_workers"] == {}
    finally:
        bad.close()
        good.close()


_drop_steps = st.lists(st.tuples(st.floats(0, 200), st.dictionaries(st.sampled_from(["a", "b", "c"]),
                                                                     st.integers(0, 5), max_size=3)), max_size=20)


@given(_drop_steps)
@settings(max_examples=200, deadline=None)
def test_worker_drop_counts_and_dropping_window(steps: list[tuple[float, dict[str, int]]]) -> None:
    w = RegisteredWorker(RegisterWorker("w", "tcp://127.0.0.1:1"), now=0.0)
    now, want, last = 0.0, {}, None
    for dt, drops in steps:
        now += dt
        added = w.note_drops(drops, now)
        assert added == sum(drops.values())
        for r, n in drops.items():
            if n:
                want[r] = want.get(r, 0) + n
        last = now if added else last
        assert w.drops == want
        for later in (0.0, DROPPING_WINDOW_S - 1, DROPPING_WINDOW_S):
            assert w.dropping(now + later, DROPPING_WINDOW_S) == (last is not None and now + later - last < DROPPING_WINDOW_S)


def test_drop_warning_is_rate_limited_per_worker(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvatlas.ingest")
    registry, metrics = Registry(), ServiceMetrics()
    loop = IngestLoop(index=default_index(ServiceConfig()), registry=registry, lock=threading.Lock(), metrics=metrics,
                      subscriber_factory=lambda: None)
    a = registry.add(RegisterWorker("a", "tcp://127.0.0.1:1"), now=0.0)
    b = registry.add(RegisterWorker("b", "tcp://127.0.0.1:2"), now=0.0)
    for t in range(0, 130, 5):  # every 5 s for 130 s: a warning at 0, 60 and 120 s
        loop._worker_dropped(a, {"block_size_mismatch": 2}, float(t))
    loop._worker_dropped(b, {"decode_malformed": 1}, 1.0)  # another worker has its own allowance
    loop._worker_dropped(b, {}, 2.0)  # nothing dropped: nothing said
    lines = [r.getMessage() for r in caplog.records if "event=worker_dropping" in r.getMessage()]
    assert [ln.split()[1] for ln in lines] == ["worker=a", "worker=a", "worker=a", "worker=b"]
    assert "drops=block_size_mismatch:50" in lines[2] and DROP_WARN_INTERVAL_S == 60.0  # the total so far
    loop._tally.flush(metrics)
    assert metrics.worker_drops.get("a", "block_size_mismatch") == 52 and metrics.worker_drops.get("b", "decode_malformed") == 1


def _worker(wid: str, indexer: str, port: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return spawn([sys.executable, "-m", "cli.main", "--log-level", "INFO", "worker", "--id", wid,
                      "--port", str(port), "--indexer", indexer, "--gpu-pages", "16", "--host-pages", "0", *extra],
                     cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_kvatlas_workers_are_back_within_20s_of_an_indexer_restart(tmp_path: Path) -> None:
    """An indexer, two `kvatlas worker`s and a third whose block size conflicts, as processes: the
    third is refused (409) and exits; the indexer is killed and started again on its port without a
    snapshot; both workers are registered again, url included, within 20 s of it answering."""
    port = free_port()
    idx = KVIndexerProcess(port, "--block-size", str(BS), log_path=tmp_path / "idx.log")
    http = {w: free_port() for w in ("wa", "wb", "wc")}
    procs = {w: _worker(w, idx.url, http[w], tmp_path / f"{w}.log") for w in ("wa", "wb")}
    procs["wc"] = _worker("wc", idx.url, http["wc"], tmp_path / "wc.log", "--block-size", "32")
    try:
        idx.wait_ready()

        def listed(c: httpx.Client) -> dict[str, str | None]:
            return {w["worker_id"]: w["url"] for w in c.get("/workers").json()["workers"]}
        wait_until(lambda: len(listed(idx.client)) == 2, timeout=180, interval=0.2)
        assert listed(idx.client) == {w: f"http://127.0.0.1:{http[w]}" for w in ("wa", "wb")}
        assert procs["wc"].wait(180) != 0
        assert "409" in (tmp_path / "wc.log").read_text() and "conflicts" in (tmp_path / "wc.log").read_text()

        idx.kill()
        idx = KVIndexerProcess(port, "--block-size", str(BS), log_path=tmp_path / "idx2.log")
        idx.wait_ready()
        wait_until(lambda: len(listed(idx.client)) == 2, timeout=20, interval=0.1)
        assert listed(idx.client) == {w: f"http://127.0.0.1:{http[w]}" for w in ("wa", "wb")}
        assert all("event=reregistered" in (tmp_path / f"{w}.log").read_text() for w in ("wa", "wb"))
    finally:
        for p in procs.values():
            stop(p)
        if idx.proc.poll() is None:
            idx.terminate()
