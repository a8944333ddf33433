"""`kvatlas demo --in-process` (the fast example): real caches, real ZMQ, the index checked against the
caches' truth. The multi-process demo is tested in tests/test_demo_fleet.py."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from router_api.demo.inprocess import DemoConfig, main

ROOT = Path(__file__).resolve().parents[1]


def test_demo_index_equals_caches_and_routing_beats_round_robin() -> None:
    out = io.StringIO()
    cfg = DemoConfig(workers=3, requests=150, prefixes=12, prefix_tokens=256, device_pages=48, host_pages=160)
    assert main(cfg, out=out) == 0, out.getvalue()
    text = out.getvalue()
    table = text.split("index == caches", 1)[1].splitlines()[1:3]  # the two policy rows
    rows = {line.split()[0]: line.split() for line in table}
    assert rows["round-robin"][-1] == "yes" and rows["kvatlas"][-1] == "yes", text
    # Cache-aware routing must find more reuse than round-robin on a shared-prefix stream.
    assert float(rows["kvatlas"][1]) > float(rows["round-robin"][1]), text
    assert "MISMATCH" not in text


def test_demo_cli_runs_and_rejects_bad_arguments() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    exe = [sys.executable, "-m", "cli.main"]
    ok = subprocess.run([*exe, "demo", "--in-process", "--workers", "2", "--requests", "40"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "index == caches" in ok.stdout
    bad = subprocess.run([*exe, "demo", "--workers", "0"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "--workers must be positive" in bad.stderr
