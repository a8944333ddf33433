"""`kvatlas worker` as a real process: /generate reports where tokens came from (GPU after a repeat,
host after GPU churn), /load, /health, /metrics, clear errors for bad bodies, and its KV events
reach a real indexer (the index's score equals the worker's truth)."""
from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from router.demo.procs import Child, http_json, wait_healthy
from support.net import free_port, wait_until

BLOCK = 512


def post(url: str, body: bytes | dict, ctype: str = "application/json") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def fleet(tmp_path: Path):
    ip, wp = free_port(), free_port()
    cmd = [sys.executable, "-m", "cli.main", "--log-level", "WARNING"]
    idx = Child("indexer", [*cmd, "indexer", "--port", str(ip), "--block-size", str(BLOCK), "--model", "m"], tmp_path)
    w = Child("worker", [*cmd, "worker", "--id", "w0", "--port", str(wp), "--indexer", f"http://127.0.0.1:{ip}",
                         "--model", "m", "--block-size", str(BLOCK), "--gpu-pages", "8", "--host-pages", "32", "--l3", "file",
                         "--l3-dir", str(tmp_path / "l3"), "--speed", "1000"], tmp_path)
    try:
        wait_healthy([(idx, f"http://127.0.0.1:{ip}"), (w, f"http://127.0.0.1:{wp}")])
        yield f"http://127.0.0.1:{ip}", f"http://127.0.0.1:{wp}"
    finally:
        w.stop()
        idx.stop()


def prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(blocks * BLOCK)]


def test_worker_serves_reports_truth_and_feeds_the_index(fleet) -> None:
    indexer, worker = fleet
    health = http_json(f"{worker}/health")
    assert health["worker_id"] == "w0" and health["block_size"] == BLOCK and health["l3"] == "disk"
    a = prompt(1, 4) + [5, 6, 7]
    st, r1 = post(f"{worker}/generate", {"token_ids": a, "max_tokens": 4})
    assert st == 200 and r1["served"]["computed"] == len(a) and r1["arrival_cached"] == 0
    assert r1["ttft_s"] == pytest.approx(r1["queue_s"] + r1["load_s"] + r1["prefill_s"])
    # the index learns the blocks over ZMQ; its score equals what the worker will report
    def scored() -> dict:
        res = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"{indexer}/score", data=json.dumps({"token_ids": a, "model": "m"}).encode(),
            headers={"Content-Type": "application/json"})).read())
        rows = {x["worker_id"]: x for x in res["workers"]}
        return rows.get("w0", {}).get("cached_blocks") == 4 and rows["w0"]
    row = wait_until(scored, timeout=10, interval=0.02)
    st, r2 = post(f"{worker}/generate", {"token_ids": a, "max_tokens": 4, "arrival_s": 100.0})
    assert st == 200 and r2["arrival_cached"] == row["cached_blocks"] * BLOCK == 4 * BLOCK
    assert r2["served"]["gpu"] == 4 * BLOCK and r2["served"]["computed"] == 3
    # churn the 8-page GPU: the first prompt survives on the host (write-through) and loads back
    for s in range(2, 5):
        assert post(f"{worker}/generate", {"token_ids": prompt(s, 4), "max_tokens": 1})[0] == 200
    st, r3 = post(f"{worker}/generate", {"token_ids": a, "max_tokens": 1})
    assert st == 200 and r3["served"]["host"] + r3["served"]["disk"] > 0 and r3["load_s"] > 0
    load = http_json(f"{worker}/load?at=0")
    assert load["total_pages"] == {"gpu": 8, "host": 32} and load["queued"] >= 0
    assert load["events_seq"] is None  # only a settling read names it
    # settle: every request sent before is served and its events published; the indexer reaches that seq
    settled = http_json(f"{worker}/load?at=0&settle=true")
    assert isinstance(settled["events_seq"], int) and settled["events_seq"] >= 5  # a batch per request at least
    assert wait_until(lambda: (http_json(f"{indexer}/workers/w0").get("last_seq") or -1) >= settled["events_seq"],
                      timeout=10, interval=0.02)
    metrics = urllib.request.urlopen(f"{worker}/metrics").read().decode()
    assert 'kvatlas_worker_requests_total{worker="w0",outcome="ok"} 6' in metrics


def test_worker_rejects_bad_bodies_clearly(fleet) -> None:
    _, worker = fleet
    assert post(f"{worker}/generate", b"{not json")[0] == 400
    st, body = post(f"{worker}/generate", {"token_ids": [-1]})
    assert st == 422 and "invalid request" in body["error"]
    assert post(f"{worker}/generate", {"token_ids": []})[0] == 422
    assert post(f"{worker}/generate", {"token_ids": [1], "bogus": 1})[0] == 422
    assert post(f"{worker}/generate", {"token_ids": [1, 2], "max_tokens": 1})[0] == 200  # still serving


def test_worker_cli_rejects_bad_configuration(tmp_path: Path) -> None:
    import subprocess
    cmd = [sys.executable, "-m", "cli.main", "worker"]
    for args, msg in ((["--l3", "file"], "--l3-dir"), (["--sim", "{\"bogus\": 1}"], "bad configuration"),
                      (["--gpu-pages", "0"], "must be positive"),
                      (["--l3", "redis", "--l3-config", "{\"nope\": 1}"], "bad L3 configuration")):
        r = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr)
