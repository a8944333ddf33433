"""Worker churn at width, the service's side (docs/scaling.md, "The index at scale"): registering,
removing and re-registering a worker in a wide registry costs that worker, not a pass over the fleet
(counted: the registry's worker table and a metric's series are dicts that count passes over them),
and what the registry and the per-worker metric series hold stays the live fleet's after churn."""
from __future__ import annotations

import pytest

from router_api.metrics import Counter, ServiceMetrics
from router_api.registry import ConflictingBlockSize, DuplicateWorker, Registry
from schemas.api import RegisterWorker
from support.counting import CountingDict


def reg(i: int, model: str = "m", block_size: int = 16, port: int | None = None) -> RegisterWorker:
    return RegisterWorker(worker_id=f"w{i}", endpoint=f"tcp://127.0.0.1:{port or 20000 + i}", model=model,
                          block_size=block_size)


def test_register_and_remove_make_no_pass_over_the_fleet() -> None:
    r = Registry(max_workers=5000)
    for i in range(3000):
        r.add(reg(i), 0.0)
    r._workers = CountingDict(r._workers)
    before = CountingDict.passes
    for i in range(3000, 3010):  # add, remove, restart (remove and add again)
        r.add(reg(i), 1.0)
    for i in range(0, 3000, 300):
        r.remove(f"w{i}")
        r.add(reg(i), 2.0)
        r.remove(f"w{i}")
    assert r.block_size_of("m") == 16 and r.models() == {"m": 16}
    assert CountingDict.passes == before
    assert len(r) == 3000
    # the checks the indexes answer are still made
    with pytest.raises(DuplicateWorker, match="w5"):
        r.add(reg(9999, port=20005), 3.0)  # w5's publisher
    with pytest.raises(ConflictingBlockSize):
        r.add(reg(9999, block_size=32), 3.0)
    r.add(reg(9999, port=20000), 3.0)  # w0's endpoint is free again (w0 was removed)
    # a changed registration is judged as if the worker it replaces were gone
    r.check(RegisterWorker(worker_id="w1", endpoint="tcp://127.0.0.1:20001", model="m", block_size=16),
            replacing="w1")


def test_a_model_goes_with_its_last_worker() -> None:
    r = Registry()
    r.add(reg(1, model="a", block_size=8), 0.0)
    r.add(reg(2, model="a", block_size=8), 0.0)
    r.remove("w1")
    assert r.block_size_of("a") == 8
    r.remove("w2")
    assert r.block_size_of("a") is None and r.models() == {}
    r.add(reg(3, model="a", block_size=32), 0.0)  # its block size is free again
    assert r.models() == {"a": 32}
    # the only worker of a model may change its block size (replacing itself)
    r.check(reg(3, model="a", block_size=64), replacing="w3")


def test_forgetting_a_worker_costs_its_series_and_leaves_the_fleet_proportional() -> None:
    m = ServiceMetrics()
    for i in range(2000):
        m.batches.inc(f"w{i}", "events")
        m.gaps.inc(f"w{i}")
        m.worker_lag.set(f"w{i}", value=0.1)
        m.worker_blocks.set(f"w{i}", "gpu", value=3.0)
    for c in (m.batches, m.gaps, m.worker_lag, m.worker_blocks):
        c._values = CountingDict(c._values)
    before = CountingDict.passes
    for i in range(0, 2000, 2):  # churn: half go, a tenth of those come back
        m.forget_worker(f"w{i}")
        if i % 20 == 0:
            m.batches.inc(f"w{i}", "events")
    assert CountingDict.passes == before
    assert len(m.batches.items()) == 1000 + 100
    assert len(m.gaps.items()) == len(m.worker_lag.items()) == len(m.worker_blocks.items()) == 1000
    assert m.batches.get("w0", "events") == 1.0  # an id used again starts from zero
    assert m.gaps.get("w1") == 1.0 and m.gaps.get("w2") == 0.0


def test_gauge_replace_keeps_forget_exact() -> None:
    g = ServiceMetrics().worker_blocks
    g.set("a", "gpu", value=1.0)
    g.replace({("b", "gpu"): 2.0, ("b", "host"): 1.0, ("c", "gpu"): 4.0})
    g.forget("a")
    g.forget("b")
    assert g.items() == [(("c", "gpu"), 4.0)]
    c = Counter("x_total", "x", ("worker", "k"))
    c.inc_many({("a", "1"): 1.0, ("a", "2"): 2.0, ("b", "1"): 1.0})
    c.forget("a")
    assert c.items() == [(("b", "1"), 1.0)]
