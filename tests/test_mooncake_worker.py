"""`kvatlas worker --l3 mooncake` as processes: two workers on one real `mooncake_master`, an
indexer. What worker A computed is scored as the shared tier for worker B (which never saw it),
and B serves it from the store (`served.shared`), skipping its prefill."""
from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

from router.demo.procs import Child, http_json, wait_healthy
from support.mooncake import MooncakeMaster, mooncake_master  # noqa: F401
from support.net import free_port, wait_until

BLOCK = 16


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_worker_b_serves_from_the_store_what_worker_a_computed(mooncake_master: MooncakeMaster,
                                                                tmp_path: Path) -> None:
    ip = free_port()
    cmd = [sys.executable, "-m", "cli.main", "--log-level", "WARNING"]
    indexer = f"http://127.0.0.1:{ip}"
    children = [Child("indexer", [*cmd, "indexer", "--port", str(ip), "--block-size", str(BLOCK), "--model", "m"],
                      tmp_path)]
    urls = {}
    cfg = json.dumps(mooncake_master.backend_config())
    try:
        wait_healthy([(children[0], indexer)])
        for wid in ("a", "b"):
            wp = free_port()
            urls[wid] = f"http://127.0.0.1:{wp}"
            children.append(Child(wid, [*cmd, "worker", "--id", wid, "--port", str(wp), "--indexer", indexer,
                                        "--model", "m", "--block-size", str(BLOCK), "--gpu-pages", "64",
                                        "--host-pages", "128", "--l3", "mooncake", "--l3-config", cfg,
                                        "--speed", "1000"], tmp_path, env={"GLOG_minloglevel": "2"}))
        wait_healthy([(c, urls[c.name]) for c in children[1:]])
        assert http_json(f"{urls['b']}/health")["l3"] == "shared"
        n = 20  # blocks: past the cache's prefetch threshold (256 tokens)
        prompt = [(i * 31) % 30000 + 1 for i in range(n * BLOCK)] + [5, 6, 7]
        r = post(f"{urls['a']}/generate", {"token_ids": prompt, "max_tokens": 1})
        assert r["served"]["computed"] == len(prompt)

        def shared_for_b() -> dict | bool:
            res = post(f"{indexer}/score", {"token_ids": prompt, "model": "m"})
            rows = {x["worker_id"]: x for x in res["workers"]}
            b = rows.get("b")
            return bool(b) and b["tiers"]["shared"] == n and b["device_blocks"] == 0 and b
        row = wait_until(shared_for_b, timeout=20, interval=0.05)
        assert row["cached_blocks"] == n
        r = post(f"{urls['b']}/generate", {"token_ids": prompt, "max_tokens": 1, "arrival_s": 100.0})
        assert r["arrival_cached"] == n * BLOCK
        assert r["served"]["shared"] == n * BLOCK and r["served"]["computed"] == 3, r
    finally:
        for c in reversed(children):
            c.stop()
