"""No silent slowdown: without the C accelerator `kvatlas indexer` says so at start, and /health and
/metrics name the core in use (docs/service.md)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from support.net import free_port, wait_until
from router_api.procs import spawn

ROOT = Path(__file__).resolve().parent.parent


def test_pure_python_core_is_announced_and_reported() -> None:
    port = free_port()
    env = dict(os.environ, KVATLAS_PURE_PYTHON="1")
    proc = spawn([sys.executable, "-m", "cli.main", "--log-level", "WARNING", "indexer",
                             "--port", str(port)], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)

    def health() -> dict | None:
        assert proc.poll() is None, "indexer exited"
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
        except httpx.HTTPError:
            return None

    try:
        assert wait_until(health, timeout=60, interval=0.05)["core"] == "python"  # type: ignore[index]
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        assert 'kvatlas_index_core{core="python"} 1.0' in metrics
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "WARNING: the C accelerator" in err and "pure-Python index core" in err
