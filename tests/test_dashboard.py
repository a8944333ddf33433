"""The dashboard at `/`, rendered by headless Chromium against a live indexer fed by real
publishers: the page must show every worker with its status and block counts per tier, the event
totals and drops reported by the service. Skips (saying why) only when chromium is absent."""
from __future__ import annotations

import html
import random
import re
import shutil
import subprocess
import tempfile

import pytest

from support.net import free_port
from router_api.config import ServiceConfig
from support.fleet import BS, Fleet
from support.service import LiveIndexer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _render(url: str) -> str:
    assert CHROMIUM, "chromium not installed: make test installs it (scripts/ensure-system-deps.sh)"
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             f"--user-data-dir={profile}", "--virtual-time-budget=4000", "--dump-dom", url],
            capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _cell(dom: str, worker: str, tier: str) -> int:
    row = re.search(rf'<tr data-worker="{worker}" data-status="(\w+)"[^>]*>(.*?)</tr>', dom, re.S)
    assert row, f"no row for {worker}"
    m = re.search(rf'data-tier="{tier}">([\d,]+)<', row.group(2))
    assert m, (worker, tier, row.group(2)[:500])
    return int(m.group(1).replace(",", ""))


def test_dashboard_renders_workers_and_numbers() -> None:
    li = LiveIndexer(ServiceConfig(port=free_port(), block_size=BS, auth_token="dash-token",
                                   stats_ttl_s=0.0)).start()
    fleet = Fleet(li.client, 3, seed=31)
    try:
        marks = fleet.run(40, random.Random(31))
        fleet.pubs["w1"].publish_payload(b"\xc1 garbage")  # one drop to show
        fleet.pubs["w1"].flush(10)  # next_seq counts sent batches: exact once the queue is empty
        marks["w1"] = fleet.pubs["w1"].next_seq - 1
        fleet.settle(marks)
        for _ in range(3):
            li.client.post("/score", json={"token_ids": fleet.sims["w0"].history[-1]})
        rows = {w["worker_id"]: w for w in li.client.get("/workers").json()["workers"]}
        stats = li.client.get("/stats").json()

        dom = _render(f"{li.url}/?token=dash-token")
        assert 'id="conn" class="ok">live<' in dom, dom[:3000]
        assert re.search(r'id="n-workers">3<', dom)
        for wid, row in rows.items():
            dropping = "1" if wid == "w1" else "0"  # w1's events were dropped (its garbage payload)
            assert re.search(rf'<tr data-worker="{wid}" data-status="live" data-dropping="{dropping}">', dom), wid
            for tier in ("gpu", "host"):
                assert _cell(dom, wid, tier) == row["blocks"][tier] and (tier == "host" or row["blocks"][tier] > 0)
        total = int(re.search(r'id="events-total">([\d,]+)<', dom).group(1).replace(",", ""))
        assert total == int(stats["events_total"]) > 0
        assert re.search(r'<tr data-key="decode_malformed"><td class="drop-bad">decode_malformed</td>'
                         r'<td class="num">1</td>', dom), "drop by reason not shown"
        p50 = html.unescape(re.search(r'id="score-p50">([^<]+)<', dom).group(1))
        assert p50.endswith(" ms") and float(p50.split()[0]) > 0
        assert re.search(r'class="bar"[^>]*><span class="gpu" style="width:[\d.]+%"', dom)  # tier bars drawn
        # freshness per worker, the core in use, restarts and drops, and the short history
        for wid in rows:
            cell = re.search(rf'<tr data-worker="{wid}".*?data-silent="([\d.]+)"', dom, re.S)
            assert cell and 0 <= float(cell.group(1)) < 600, wid
        assert re.search(rf'id="core">{li.client.get("/health").json()["core"]}<', dom)
        assert re.search(r'id="restarts">\d+ · 1<', dom)  # the one drop above
        assert rows["w1"]["drops"] == {"decode_malformed": 1} and rows["w1"]["dropping"]
        assert re.search(r'<tr data-worker="w1".*?<span class="status dropping"[^>]*>dropping</span>.*?'
                         r'data-drops="1" title="decode_malformed 1">1<', dom, re.S), "w1's drops not shown"
        assert re.search(r'<polyline points="[^"]+" stroke="var\(--gpu\)" data-series="gpu"', dom)  # several polls drawn

        # Without the token the page is refused (the JSON error is what the browser shows).
        dom = _render(f"{li.url}/")
        assert "missing or invalid bearer token" in dom and 'id="workers"' not in dom
    finally:
        fleet.close()
        li.stop()
