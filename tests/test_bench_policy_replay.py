"""`bench/bench_policy_replay.py`, the in-process stand-in for the demo's one-router rows: on a short
builtin-chat slice its replays are deterministic, the precise policy's predictions are exact, and the
cache-aware policies compute less than round-robin. Correctness only: nothing here is timed."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from bench import bench_policy_replay as bp  # noqa: E402


def test_replays_are_deterministic_exact_and_cache_aware() -> None:
    reqs = bp.requests_for("builtin-chat", 40, 2)
    ex = bp.TokenExpander()
    tokens = [ex.tokens(r) for r in reqs]
    run = {p: bp.replay(p, reqs, tokens, 2, 2, 64, 128) for p in ("round_robin", "approximate", "precise_tiered")}
    again = bp.replay("precise_tiered", reqs, tokens, 2, 2, 64, 128)
    assert again == run["precise_tiered"]
    assert run["precise_tiered"]["accuracy"] == 1.0
    assert run["round_robin"]["accuracy"] != run["round_robin"]["accuracy"]  # NaN: no prediction
    assert run["precise_tiered"]["prefill"] < run["round_robin"]["prefill"]
    assert run["approximate"]["prefill"] < run["round_robin"]["prefill"]
