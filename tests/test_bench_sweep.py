"""`bench/bench_sweep.py` in short mode: the load sweep runs on the simulated clock, so two runs give
the same figures to the token and the nanosecond; the offline bound computes no more than any
policy and is no slower at p90; the precise rows' predictions are exact. Correctness only: nothing
here is timed."""
from __future__ import annotations

from bench import bench_sweep as bs
from router_api.router.trace import conversations
from sim.api import SimModel

ROWS = (("round_robin", 1), ("approximate", 1), ("precise_tiered", 1), ("precise_tiered", 2))


def quiet(*_a, **_k) -> None:
    pass


def comparable(res: dict) -> dict:
    """NaN (no prediction) as None, so equal runs compare equal."""
    return {load: {name: {k: (None if v != v else v) for k, v in m.items()} for name, m in rows.items()}
            for load, rows in res.items()}


def test_sweep_repeats_exactly_and_the_bound_bounds() -> None:
    args = ("builtin-conversation", 40, 2, [0.6, 1.3], 2, 64, 128)
    first = bs.sweep(*args, rows=ROWS, out=quiet)
    assert comparable(bs.sweep(*args, rows=ROWS, out=quiet)) == comparable(first)
    for load in (0.6, 1.3):
        rows = first[load]
        bound = rows["offline bound"]
        for name, m in rows.items():
            assert bound["prefill"] <= m["prefill"] and bound["p90"] <= m["p90"], name
        assert rows["precise_tiered x1"]["accuracy"] == 1.0 and rows["precise_tiered x2"]["accuracy"] == 1.0
    # a higher offered load queues more: round-robin's p90 grows with it
    assert first[1.3]["round_robin x1"]["p90"] > first[0.6]["round_robin x1"]["p90"]


def test_offline_bound_counts_each_block_once() -> None:
    reqs = conversations(30, seed=1)
    b = bs.offline_bound(reqs, SimModel())
    blocks = {h for r in reqs for h in r.hash_ids}
    assert b["prefill"] <= len(blocks) * bs.P
    assert b["prefill"] >= len(blocks) * bs.P - len(reqs) * bs.P  # last partial blocks only
    assert 0.0 < b["hit"] < 1.0
    faster = bs.scaled(reqs, 2.0)
    assert [r.arrival_s for r in faster] == [r.arrival_s / 2.0 for r in reqs]
