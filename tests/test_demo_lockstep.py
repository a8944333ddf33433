"""`kvatlas demo` in lockstep (its default, docs/end-to-end.md "Lockstep") on real processes: two runs
of the same trace, seed and fleet give the same table, every column of every row, and the rows are
the deterministic in-process replay's (bench/bench_policy_replay.py: the same engines and policies
driven from one thread, no processes, no event lag)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.bench_policy_replay import replay
from router.trace import TokenExpander, requests_for

ROOT = Path(__file__).resolve().parents[1]
N, WORKERS = 24, 2


def _demo(tmp_path: Path, name: str) -> list[dict]:
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # --speed 40: the run is paced by its serial decisions, not the trace (the rows do not depend on it)
    r = subprocess.run([sys.executable, "-m", "cli.main", "demo", "--requests", str(N), "--workers", str(WORKERS),
                        "--policies", "least_loaded,precise_tiered", "--routers", "2",
                        "--speed", "40", "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())["policies"]


def test_two_lockstep_runs_give_identical_rows_equal_to_the_in_process_replay(tmp_path: Path) -> None:
    first, second = _demo(tmp_path, "a"), _demo(tmp_path, "b")
    assert [(x["policy"], x["routers"]) for x in first] == [
        ("least_loaded", 1), ("precise_tiered", 1), ("approximate", 2), ("precise_tiered", 2)]
    assert first == second
    reqs = requests_for(None, N, 0)
    ex = TokenExpander()
    tokens = [ex.tokens(r) for r in reqs]
    for x in first:
        assert x["requests"] == N and not x["causes"] and x["waits"] == 0, x
        if x["policy"] == "precise_tiered" and x["routers"] > 1:
            continue  # the indexer decides for every replica with one policy state; the replay keeps one each
        m = replay(x["policy"], reqs, tokens, WORKERS, 0, 320, 960, routers=x["routers"])
        assert x["prefill_tokens"] == m["prefill"], x
        assert abs(x["ttft_p90_s"] - m["p90"]) < 1e-3 and abs(x["ttft_mean_s"] - m["mean"]) < 1e-3, (x, m)
