"""In-flight routes under attack (issue 37, findings 1, 5, 10, 11, 12): what another party reports is
bounded, kept only while its route is, and forgotten without traffic; route ids are never handed to
other clients; waits for admission are bounded, indexed by route and end when their client leaves."""
from __future__ import annotations

import math
import socket
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.pending import DEFAULT_MAX_ROUTES, PendingRoutes
from router_api.config import ServiceConfig
from support.net import free_port, wait_until
from support.service import LiveIndexer, indexer_with_publishers

BS = 4


@pytest.fixture(scope="module")
def live() -> Iterator[LiveIndexer]:
    config = ServiceConfig(port=free_port(), block_size=BS, stats_ttl_s=0.0)
    with indexer_with_publishers(config, ["hw0", "hw1"], BS) as li:
        li.service.routes.pending.admit_timeout_s = 60.0  # only the deadline's own test relies on it (a loaded machine)
        yield li


def _report(li: LiveIndexer, rid: str, worker: str, toks: list[int], **kw: object) -> dict:
    r = li.client.post("/routes", json={"request_id": rid, "worker_id": worker, "token_ids": toks, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def _row(li: LiveIndexer, toks: list[int], worker: str) -> dict:
    rows = li.client.post("/score", json={"token_ids": toks}).json()["workers"]
    return next(r for r in rows if r["worker_id"] == worker)


# -- 1: busy_until -------------------------------------------------------------------------------

def test_busy_until_is_forgotten_with_its_route_and_bounded() -> None:
    p = PendingRoutes(ttl_s=5.0)
    p.add("m", "poison", "w0", 0, [1], now=0.0, busy_until=1e12)  # the schema's own maximum
    p.add("m", "honest", "w0", 0, [2], now=0.0, busy_until=50.0)
    assert p.busy_until("m", "w0", 0, 0.0) == 1e12
    p.release("m", "poison")  # its route went: so does its end time
    assert p.busy_until("m", "w0", 0, 0.0) == 50.0
    for bad in (math.inf, -math.inf, math.nan, 1e300):  # never kept, never masking the honest value
        p.add("m", f"bad-{bad}", "w0", 0, [3], now=0.0, busy_until=bad)
        assert p.busy_until("m", "w0", 0, 0.0) == 50.0
    assert p.busy_refused == 4
    p.add("m", "dropped", "w1", 0, [4], now=0.0, busy_until=99.0)
    p.clear_worker("m", "w1")
    assert p.busy_until("m", "w1", 0, 0.0) is None


_busy_op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 5), st.integers(0, 2),
              st.one_of(st.none(), st.floats(-1e12, 1e12), st.sampled_from([math.inf, -math.inf, math.nan, 1e300]))),
    st.tuples(st.just("release"), st.integers(0, 5)),
    st.tuples(st.just("confirm"), st.integers(0, 5)),
    st.tuples(st.just("clock"), st.floats(0.0, 3.0)),
    st.tuples(st.just("clear"), st.integers(0, 2)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_busy_op, min_size=1, max_size=40))
def test_busy_until_is_the_largest_value_of_the_routes_held(ops: list[tuple]) -> None:
    """Against a reference model: a pair's busy_until is the largest valid value among its routes that
    are held, or confirmed and within their TTL; released, expired, re-reported or cleared, a value goes."""
    p = PendingRoutes(ttl_s=5.0)
    now = 0.0
    model: dict[str, tuple[str, float | None, float, bool]] = {}  # rid -> (worker, busy, expires, confirmed)
    for o in ops:
        if o[0] == "add":
            rid, w = f"r{o[1]}", f"w{o[2]}"
            p.add("m", rid, w, 0, [o[1] + 1], now=now, busy_until=o[3])
            ok = o[3] is not None and math.isfinite(o[3]) and abs(o[3]) <= 1e12
            model[rid] = (w, o[3] if ok else None, now + 5.0, False)
        elif o[0] == "release":
            p.release("m", f"r{o[1]}")
            model.pop(f"r{o[1]}", None)
        elif o[0] == "confirm":
            rid = f"r{o[1]}"
            if p.confirm("m", rid) and rid in model:
                model[rid] = (*model[rid][:3], True)
        elif o[0] == "clock":
            now += o[1]
            p.expire(now)
        else:
            p.clear_worker("m", f"w{o[1]}")
            model = {k: v for k, v in model.items() if v[0] != f"w{o[1]}"}
        model = {k: v for k, v in model.items() if v[2] > now}
        for i in range(3):
            vals = [v[1] for v in model.values() if v[0] == f"w{i}" and v[1] is not None]
            assert p.busy_until("m", f"w{i}", 0, now) == (max(vals) if vals else None), (o, model)
        held = any(not v[3] for v in model.values())
        assert p.active("m") == (held or any(v[1] is not None for v in model.values()))


def test_busy_until_over_http_follows_the_route(live: LiveIndexer) -> None:
    toks = list(range(7000, 7000 + 2 * BS))
    _report(live, "b-1", "hw0", toks, busy_until=1e12)
    assert _row(live, toks, "hw0")["busy_until"] == 1e12
    assert live.client.delete("/routes/b-1").json() == {"released": 2}
    assert _row(live, toks, "hw0").get("busy_until") is None


# -- 11: caps per worker, budgeted sweep, expiry without traffic ---------------------------------

def test_a_flooded_worker_cannot_push_out_other_workers_routes() -> None:
    p = PendingRoutes(ttl_s=60.0)
    p.add("m", "legit", "w1", 0, [1, 2, 3], now=0.0)
    for i in range(DEFAULT_MAX_ROUTES + 10):
        p.add("m", f"flood-{i}", "w0", 0, [10 + i], now=0.0)
    assert p.run("m", "w1", 0, [1, 2, 3]) == 3  # still held
    assert len(p) <= DEFAULT_MAX_ROUTES and p.counts.dropped >= 10


def test_confirmation_sweep_is_budgeted(live: LiveIndexer) -> None:
    """13.5k routes to a worker whose stream moved cost one `/score` a bounded number of index
    lookups, not one per route."""
    svc = live.service
    calls = []
    cls = type(svc.index)

    class Counting(cls):
        __slots__ = ()

        def score_keys(self, *a: object, **kw: object) -> object:
            calls.append(1)
            return super().score_keys(*a, **kw)

    with svc.lock:
        for i in range(5000):
            svc.routes.report(svc.index, svc.registry, "default", f"sw-{i}", "hw1", 0, [900_000 + i], svc.clock(), BS)
        w = svc.registry.get("hw1")
        w.last_seq = (w.last_seq or 0) + 1  # its stream moved: every route is a candidate for confirmation
        svc.index.__class__ = Counting
        try:
            svc.routes.sweep(svc.index, svc.registry, "default", svc.clock())
        finally:
            svc.index.__class__ = cls
        svc.routes.forget_worker("default", "hw1")
    assert 0 < len(calls) <= 2100, len(calls)


def test_routes_expire_without_traffic(live: LiveIndexer) -> None:
    pend = live.service.routes.pending
    ttl = pend.ttl_s
    pend.ttl_s = 0.3
    try:
        for i in range(50):
            _report(live, f"ttl-{i}", "hw0", list(range(8000 + i, 8000 + i + BS)))
        wait_until(lambda: len(pend) == 0, timeout=20)  # no request came: the timer expired them
    finally:
        pend.ttl_s = ttl


# -- 5, 12: opaque handles; admission deadline ---------------------------------------------------

def test_after_never_hands_out_another_routers_route_id(live: LiveIndexer) -> None:
    base = list(range(9000, 9000 + 3 * BS))
    _report(live, "victim-secret-id", "hw0", base, admits=True)
    try:
        after = _report(live, "attacker", "hw0", base + [1] * BS, admits=True)["after"]
        assert len(after) == 1 and "victim-secret-id" not in after[0]
        # the handle is good for waiting, and for nothing else
        assert live.client.post("/routes/admitted", json={"request_id": after[0]}).json() == {"admitted": False}
        assert live.client.delete(f"/routes/{after[0]}").json() == {"released": 0}
        live.client.post("/routes/admitted", json={"request_id": "victim-secret-id"})
        got = live.client.post("/routes/wait", json={"request_ids": after, "timeout_s": 30}).json()
        assert got["waiting"] == []
    finally:
        for rid in ("victim-secret-id", "attacker"):
            live.client.delete(f"/routes/{rid}")


def test_an_admission_never_reported_stops_blocking_at_its_deadline(live: LiveIndexer) -> None:
    p = PendingRoutes(ttl_s=10.0, admit_timeout_s=1.0)
    p.add("m", "never", "w0", 0, [1, 2], now=0.0, admits=True)
    assert p.awaiting("m", "never") and p.expire(0.99) == 0 and p.awaiting("m", "never")
    p.expire(1.0)
    assert not p.awaiting("m", "never") and p.admission_expired == 1 and p.run("m", "w0", 0, [1, 2]) == 2

    base = list(range(9500, 9500 + 3 * BS))
    live.service.routes.pending.admit_timeout_s = 5.0
    _report(live, "never-admits", "hw1", base, admits=True)
    try:
        after = _report(live, "dependent", "hw1", base + [2] * BS, admits=True)["after"]
        assert after
        got = live.client.post("/routes/wait", json={"request_ids": after, "timeout_s": 30}).json()
        assert got["waiting"] == [] and got["waited_s"] < 20  # the deadline (5 s), not the timeout, ended it
    finally:
        live.service.routes.pending.admit_timeout_s = 60.0
        for rid in ("never-admits", "dependent"):
            live.client.delete(f"/routes/{rid}")


# -- 10: waits ------------------------------------------------------------------------------------

def _gauge(li: LiveIndexer) -> int:
    return li.client.get("/stats").json()["pending"]["admission"]["waiting"]


def test_a_wait_whose_client_hung_up_is_dropped(live: LiveIndexer) -> None:
    base = list(range(9700, 9700 + 3 * BS))
    _report(live, "hang-a", "hw0", base, admits=True)
    try:
        after = _report(live, "hang-b", "hw0", base + [3] * BS, admits=True)["after"]
        body = ('{"request_ids": ["%s"], "timeout_s": 30}' % after[0]).encode()
        s = socket.create_connection(("127.0.0.1", int(live.url.rsplit(":", 1)[1])))
        s.sendall(b"POST /routes/wait HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: _gauge(live) == 1, timeout=20)
        s.close()
        wait_until(lambda: _gauge(live) == 0, timeout=20)  # long before its 30 s timeout
    finally:
        for rid in ("hang-a", "hang-b"):
            live.client.delete(f"/routes/{rid}")


def test_waits_are_bounded_and_a_change_looks_only_at_its_own_waits(live: LiveIndexer) -> None:
    svc = live.service
    base = list(range(9800, 9800 + 3 * BS))
    _report(live, "w-a", "hw0", base, admits=True)
    after = _report(live, "w-b", "hw0", base + [4] * BS, admits=True)["after"]
    woken: list[int] = []
    tokens = []
    looked = []
    cls = type(svc.routes.pending)

    class Counting(cls):
        __slots__ = ()

        def awaiting(self, model: str, rid: str) -> bool:
            looked.append(rid)
            return super().awaiting(model, rid)

    try:
        for i in range(300):
            tokens.append(svc.watch_routes("default", after, lambda i=i: woken.append(i)))
        svc.routes.pending.__class__ = Counting
        for i in range(100):  # unrelated route changes: the 300 waits are not looked at
            _report(live, f"other-{i}", "hw1", [i] * BS)
            live.client.delete(f"/routes/other-{i}")
        svc.routes.pending.__class__ = cls
        assert len(looked) < 300 and woken == []
        svc.routes.max_waits = 300
        r = live.client.post("/routes/wait", json={"request_ids": after, "timeout_s": 5})
        assert r.status_code == 503, r.text  # the bound holds, refused with a clear error
        live.client.post("/routes/admitted", json={"request_id": "w-a"})
        assert sorted(woken) == list(range(300)) and _gauge(live) == 0
    finally:
        svc.routes.max_waits = 4096
        for t in tokens:
            svc.end_wait("default", after, t, 0.0)
        for rid in ("w-a", "w-b"):
            live.client.delete(f"/routes/{rid}")
    assert 'kvatlas_pending_admission_total{what="waits_refused"} 1' in live.client.get("/metrics").text
