"""In-flight ("pending") routes (indexer/pending.py, router_api/routes.py; docs/CONTRACTS.md, "Pending routes").

- The structure alone: add / release / expiry by the caller's clock / caps with counted drops /
  clearing a worker / `run` over chained keys.
- Exactness is untouched (hypothesis): a service that also takes random route reports, releases,
  clock jumps and worker removals answers every query with exactly the exact fields of a twin that
  never saw a route, on the pure core, the native core and a sharded index; its `pending_blocks`
  equal a brute-force model of the routes alive at that instant.
- Confirmation: once the worker's own events (over real ZeroMQ) cover a route, the route is
  confirmed and stops counting; a worker's restart or removal forgets its routes.
"""
from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.core import native as native_core
from indexer.hashing import namespace_seed, query_keys
from indexer.index import KVIndex
from indexer.pending import PendingRoutes
from indexer.sharded import ShardedIndex
from router_api.config import ServiceConfig
from router_api.service import IndexerService
from router_api.routes import UnknownRouteWorker, route_handle
from schemas.api import RegisterWorker
from schemas.events import KVEventBatch
from support.net import wait_until
from support.service import WorkerSim, make_prompts, service_with_publisher

BS = 4
MODEL = "default"
HAVE_NATIVE = native_core.select(None) is not None


# -- the structure ----------------------------------------------------------------------------

def test_add_release_run_and_counts() -> None:
    p = PendingRoutes(ttl_s=5.0)
    assert p.add("m", "r1", "w0", 0, [1, 2, 3], now=0.0) == 3
    assert p.add("m", "r2", "w0", 0, [1, 2, 3, 4, 5], now=0.0) == 5
    assert p.run("m", "w0", 0, [1, 2, 3, 4, 5, 6]) == 5
    assert p.run("m", "w0", 0, [1, 2, 3, 4, 5, 6], start=2) == 3
    assert p.run("m", "w0", 1, [1, 2]) == 0 and p.run("m", "w1", 0, [1, 2]) == 0 and p.run("x", "w0", 0, [1]) == 0
    assert p.release("m", "r2") == 5 and p.release("m", "r2") == 0  # idempotent
    assert p.run("m", "w0", 0, [1, 2, 3, 4, 5]) == 3  # r1 still holds its blocks (refcounted)
    assert p.confirm("m", "r1") == 3 and not p.has("m") and p.blocks == 0 and len(p) == 0
    assert dict(p.counts.items()) == {"added": 2, "released": 1, "confirmed": 1, "expired": 0, "dropped": 0,
                                      "cleared": 0}


def test_in_flight_load_per_pair_follows_its_routes() -> None:
    p = PendingRoutes(ttl_s=5.0, max_routes=3)
    p.add("m", "r1", "w0", 0, [1, 2], now=0.0, prefill_tokens=100)
    p.add("m", "r2", "w0", 0, [1, 2, 3], now=1.0, prefill_tokens=30)
    p.add("m", "r3", "w0", 1, [], now=1.0, prefill_tokens=7)  # shorter than a block: still in flight
    load = lambda w, r: (lambda ld: None if ld is None else (ld.requests, ld.prefill_tokens))(p.load("m", w, r))  # noqa: E731
    assert (load("w0", 0), load("w0", 1), load("w1", 0)) == ((2, 130), (1, 7), None)
    p.add("m", "r2", "w0", 0, [1, 2, 3], now=1.0, prefill_tokens=40)  # re-reported: replaces its share
    assert load("w0", 0) == (2, 140)
    p.add("m", "r4", "w1", 0, [9], now=2.0, prefill_tokens=5)  # over the cap: r1 (oldest) dropped
    assert (load("w0", 0), load("w1", 0)) == ((1, 40), (1, 5))
    assert p.expire(6.5) == 2 and load("w0", 0) is None and load("w0", 1) is None
    p.confirm("m", "r4")
    assert load("w1", 0) is None and len(p) == 0


def test_busy_until_is_the_largest_reported_and_outlives_its_route_until_the_ttl() -> None:
    p = PendingRoutes(ttl_s=5.0)
    p.add("m", "r1", "w0", 0, [1], now=0.0, busy_until=30.0)
    p.add("m", "r2", "w0", 0, [2], now=1.0, busy_until=20.0)  # smaller: the larger one stays
    p.add("m", "r3", "w0", 1, [3], now=1.0)                   # none reported: none held for that rank
    assert (p.busy_until("m", "w0", 0, 1.0), p.busy_until("m", "w0", 1, 1.0), p.busy_until("m", "w1", 0, 1.0)) \
        == (30.0, None, None)
    p.confirm("m", "r1")
    p.release("m", "r2")
    p.release("m", "r3")
    assert not p.has("m") and p.active("m") and p.busy_until("m", "w0", 0, 4.9) == 30.0  # an end time, kept
    assert p.expire(5.0) == 0 and p.busy_until("m", "w0", 0, 5.0) is None and not p.active("m")
    p.add("m", "r4", "w0", 0, [4], now=6.0, busy_until=10.0)  # after its TTL a smaller one replaces it
    assert p.busy_until("m", "w0", 0, 6.0) == 10.0
    p.clear_worker("m", "w0")
    assert p.busy_until("m", "w0", 0, 6.0) is None and not p.active("m")


def test_hybrid_runs_stop_where_a_route_ends() -> None:
    """A hybrid worker leaves an in-flight request's prefix usable only at its end (window, last
    Mamba state): `ends_only` cuts the run back to the last block where a route ends."""
    p = PendingRoutes(ttl_s=5.0)
    p.add("m", "r1", "w0", 0, [1, 2, 3], now=0.0)
    p.add("m", "r2", "w0", 0, [1, 2, 3, 4, 5, 6], now=0.0)
    q = [1, 2, 3, 4, 5, 9]  # shares 5 of r2's 6 blocks
    assert p.run("m", "w0", 0, q) == 5 and p.run("m", "w0", 0, q, ends_only=True) == 3
    assert p.run("m", "w0", 0, q, start=1, ends_only=True) == 2
    assert p.run("m", "w0", 0, [1, 2, 3, 4, 5, 6, 7], ends_only=True) == 6
    p.add("m", "r3", "w0", 0, [1, 2, 3], now=0.0)  # a second route ending at block 3 (refcounted)
    assert p.release("m", "r1") == 3 and p.run("m", "w0", 0, q, ends_only=True) == 3
    assert p.release("m", "r3") == 3 and p.run("m", "w0", 0, q, ends_only=True) == 0
    assert p.release("m", "r2") == 6 and not p.has("m") and p._ends == {}


def test_expiry_follows_the_callers_clock_and_re_reports() -> None:
    p = PendingRoutes(ttl_s=2.0)
    p.add("m", "a", "w0", 0, [1], now=0.0)
    p.add("m", "b", "w0", 0, [2], now=1.0)
    p.add("m", "a", "w1", 0, [3], now=1.5)  # re-reported: replaces the first, expires later
    assert p.expire(1.99) == 0
    assert p.expire(3.0) == 1 and p.run("m", "w0", 0, [2]) == 0  # b expired at 3.0
    assert p.run("m", "w1", 0, [3]) == 1 and p.run("m", "w0", 0, [1]) == 0
    assert p.expire(3.5) == 1 and len(p) == 0 and p.counts.expired == 2


def test_caps_drop_the_oldest_and_count() -> None:
    p = PendingRoutes(ttl_s=10.0, max_routes=3, max_blocks=10)
    for i in range(5):
        p.add("m", f"r{i}", "w0", 0, [100 * i + 1], now=float(i))
    assert len(p) == 3 and p.counts.dropped == 2
    assert p.run("m", "w0", 0, [1]) == 0 and p.run("m", "w0", 0, [401]) == 1
    assert p.add("m", "big", "w0", 0, list(range(11)), now=9.0) == 0  # larger than the whole cap
    p.add("m", "nine", "w1", 0, list(range(1000, 1009)), now=9.0)  # 9 blocks: pushes older ones out
    assert p.blocks <= 10 and p.run("m", "w1", 0, list(range(1000, 1009))) == 9


def test_routes_shorter_than_a_block_hold_nothing() -> None:
    p = PendingRoutes()
    assert p.add("m", "short", "w0", 0, [], now=0.0) == 0
    assert p.add("m", "long", "w0", 0, [1, 2], now=0.0) == 2
    assert p.release("m", "long") == 2 and p.run("m", "w0", 0, [1]) == 0
    assert p.release("m", "short") == 0 and len(p) == 0 and p.blocks == 0  # no KeyError on the emptied pair
    p.add("m", "a", "w0", 0, [], now=0.0)
    assert p.expire(100.0) == 1 and not p.has("m")


def test_clear_worker_and_model() -> None:
    p = PendingRoutes()
    p.add("m", "a", "w0", 0, [1], now=0.0)
    p.add("m", "b", "w0", 1, [1], now=0.0)
    p.add("m", "c", "w1", 0, [1], now=0.0)
    assert p.clear_worker("m", "w0", 1) == 1 and p.run("m", "w0", 0, [1]) == 1
    assert p.clear_worker("m", "w0") == 1 and sorted(p.pairs("m")) == [("w1", 0)]
    assert p.clear_model("m") == 1 and p.counts.cleared == 3 and not p.has("m")
    with pytest.raises(ValueError):
        PendingRoutes(ttl_s=0)


# -- exactness is untouched (hypothesis) ------------------------------------------------------

class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _index(kind: str) -> Any:
    if kind == "sharded":
        return ShardedIndex(2, native=HAVE_NATIVE or None)
    return KVIndex(native=kind == "native")


def _service(kind: str, clock: _Clock) -> IndexerService:
    svc = IndexerService(ServiceConfig(block_size=BS, stale_after_s=1e6, remove_after_s=2e6), index=_index(kind),
                         clock=clock, pending=PendingRoutes(ttl_s=5.0, max_routes=6, admit_timeout_s=2.0))
    svc.index.ensure_model(MODEL, BS)
    return svc


def _register(svc: IndexerService, wid: str) -> None:
    svc.register(RegisterWorker(worker_id=wid, endpoint=f"tcp://127.0.0.1:{1000 + int(wid[1:])}", block_size=BS))


EXACT = ("worker_id", "dp_rank", "device_blocks", "cached_blocks", "tiers", "score", "stale", "last_seq", "status",
         "kv_blocks")


def _exact(svc: IndexerService, q: list[int]) -> list[tuple[Any, ...]]:
    return [tuple(getattr(r, f) for f in EXACT) for r in svc.score(MODEL, q).workers]


KINDS = ["python", "sharded"] + (["native"] if HAVE_NATIVE else [])

op = st.one_of(
    st.tuples(st.just("events"), st.integers(0, 2), st.integers(1, 3)),
    st.tuples(st.just("report"), st.integers(0, 2), st.integers(0, 8), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 8)),
    st.tuples(st.just("admit"), st.integers(0, 8)),
    st.tuples(st.just("clock"), st.floats(0.0, 4.0)),
    st.tuples(st.just("rejoin"), st.integers(0, 2)),
)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=30), seed=st.integers(0, 1 << 16))
def test_pending_never_changes_the_exact_view(kind: str, ops: list[tuple], seed: int) -> None:
    clock = _Clock()
    plain, routed = _service(kind, clock), _service(kind, clock)
    wids = ["w0", "w1", "w2"]
    for svc in (plain, routed):
        for w in wids:
            _register(svc, w)
    prompts = make_prompts(seed, BS, n=4, blocks=3)
    sims = {w: WorkerSim(seed + i, BS, prompts) for i, w in enumerate(wids)}
    rng = random.Random(seed)
    model: dict[str, tuple[str, list[int], float]] = {}  # request id -> (worker, keys, expires_at)
    awaiting: dict[str, float] = {}  # of them: reported with `admits`, admission not reported yet -> deadline
    handle = {f"r{i}": route_handle(routed.routes.handle_key, MODEL, f"r{i}") for i in range(9)}  # ids stay private
    seed0 = namespace_seed(BS)

    def queries() -> list[list[int]]:
        qs = [q for s in sims.values() for q in s.sample_queries(2)]
        return qs + [list(p) + [7] * BS for p in prompts] + [[5, 6]]  # and one shorter than a block

    for o in ops:
        if o[0] == "events":
            w = wids[o[1]]
            events = [e for _ in range(o[2]) for e in sims[w].step()]
            for svc in (plain, routed):
                with svc.lock:
                    svc.index.apply(MODEL, w, 0, KVEventBatch(1.0, list(events), 0))
        elif o[0] == "report":
            w = wids[o[1]]
            q = rng.choice(queries())
            rid = f"r{o[2]}"
            keys = query_keys(q, BS, seed0)
            ans = routed.report_route(MODEL, rid, w, q, admits=o[3])
            assert ans.blocks == len(q) // BS
            # causal forwarding: `after` names the routes awaiting admission that hold the last pending
            # block counted, unless a route not awaiting it holds that block too
            want: list[str] = []
            if o[3] and ans.pending_blocks:
                last = keys[ans.cached_blocks + ans.pending_blocks - 1]
                holders = [r for r, (w2, ks, _) in model.items() if w2 == w and last in ks and r != rid]
                if all(r in awaiting for r in holders):
                    want = holders
            assert sorted(ans.after) == sorted(handle[r] for r in want), (ans, holders, awaiting)
            model.pop(rid, None)  # a re-reported id replaces its route
            awaiting.pop(rid, None)
            model[rid] = (w, keys, clock.t + 5.0)
            if o[3] and keys:
                awaiting[rid] = clock.t + 2.0  # the admission deadline
            while len(model) > 6:  # the cap drops the oldest (earliest expiry)
                del model[min(model, key=lambda k: model[k][2])]
        elif o[0] == "release":
            got = routed.release_route(MODEL, f"r{o[1]}")
            entry = model.pop(f"r{o[1]}", None)
            assert got == (0 if entry is None or entry[2] <= clock.t else len(entry[1]))
        elif o[0] == "admit":
            rid = f"r{o[1]}"
            assert routed.admit_route(MODEL, rid) == (rid in awaiting and rid in model)
            awaiting.pop(rid, None)
        elif o[0] == "clock":
            clock.t += o[1]
        else:  # the worker leaves and comes back empty: the index and its routes forget it
            w = wids[o[1]]
            for svc in (plain, routed):
                svc.unregister(w)
                _register(svc, w)
            sims[w].clear()
            model = {k: v for k, v in model.items() if v[0] != w}
        model = {k: v for k, v in model.items() if v[2] > clock.t}
        awaiting = {k: t for k, t in awaiting.items() if k in model and t > clock.t}
        assert sorted(routed.routes.awaiting(MODEL, list(handle.values()), clock.t)) == sorted(handle[r] for r in awaiting)
        for q in queries():
            assert _exact(routed, q) == _exact(plain, q)
            keys = query_keys(q, BS, seed0)
            for row in routed.score(MODEL, q).workers:
                held = {k for w, ks, _ in model.values() if w == row.worker_id for k in ks}
                n = 0
                for k in keys[row.cached_blocks:]:
                    if k not in held:
                        break
                    n += 1
                assert row.pending_blocks == n, (row.worker_id, row.cached_blocks, keys, model)
                # in-flight load: the routes alive there, less those the worker's events confirmed
                alive = [ks for w, ks, _ in model.values() if w == row.worker_id]
                assert row.pending_requests <= len(alive) and row.pending_prefill_tokens <= sum(
                    len(q) for q in queries()) * len(alive)
                assert (row.pending_requests == 0) <= (row.pending_prefill_tokens == 0)
            assert plain.score_answer(MODEL, q) == routed.score_answer(MODEL, q) or routed.routes.pending.has(MODEL)


def test_report_needs_a_registered_worker_of_that_model() -> None:
    svc = _service("python", _Clock())
    _register(svc, "w0")
    with pytest.raises(UnknownRouteWorker):
        svc.report_route(MODEL, "r", "w9", list(range(8)))
    from router_api.service import UnknownModel
    with pytest.raises(UnknownModel):
        svc.report_route("nope", "r", "w0", list(range(8)))


# -- confirmation by the worker's own events, restart ------------------------------------------

def test_routes_are_confirmed_by_the_workers_events_and_forgotten_on_restart() -> None:
    from schemas.events import BlockStored
    from producer.page_hash import page_ids

    with service_with_publisher(BS) as (svc, pub):
        toks = list(range(1, 4 * BS + 3))
        assert svc.report_route("default", "r1", "w0", toks).blocks == 4
        row = svc.score("default", toks).workers[0]
        assert (row.cached_blocks, row.pending_blocks) == (0, 4)
        # the worker stores the first two blocks: they are exact now, the rest still pending
        ids = [h & ((1 << 64) - 1) for h in page_ids(toks, BS)]
        pub.publish([BlockStored(block_hashes=ids[:2], parent_block_hash=None, token_ids=toks[:2 * BS],
                                 block_size=BS, medium="GPU")])
        wait_until(lambda: svc.score("default", toks).workers[0].cached_blocks == 2, timeout=10)
        row = svc.score("default", toks).workers[0]
        assert (row.device_blocks, row.cached_blocks, row.pending_blocks) == (2, 2, 2)
        assert svc.routes.pending.counts.confirmed == 0
        pub.publish([BlockStored(block_hashes=ids[2:4], parent_block_hash=ids[1], token_ids=toks[2 * BS:4 * BS],
                                 block_size=BS, medium="GPU")])
        wait_until(lambda: svc.score("default", toks).workers[0].cached_blocks == 4, timeout=10)
        row = svc.score("default", toks).workers[0]
        assert row.pending_blocks == 0 and svc.routes.pending.counts.confirmed == 1 and len(svc.routes.pending) == 0
        assert svc.release_route("default", "r1") == 0  # already confirmed
        # a publisher restart (as the ingest loop counts it) voids the worker's routes
        longer = toks + list(range(100, 100 + 2 * BS))
        svc.report_route("default", "r2", "w0", longer)
        assert svc.score("default", longer).workers[0].pending_blocks == 2
        with svc.lock:
            svc.registry.get("w0").restarts += 1
        assert svc.score("default", longer).workers[0].pending_blocks == 0
        assert svc.routes.pending.counts.cleared == 1
        # a new route, then the worker is removed: its routes go with it
        svc.report_route("default", "r3", "w0", longer)
        assert svc.score("default", longer).workers[0].pending_blocks == 2
        svc.unregister("w0")
        assert len(svc.routes.pending) == 0 and svc.routes.pending.counts.cleared == 2
        text = svc.metrics_text()
        assert 'kvatlas_pending_routes_total{outcome="confirmed"} 1' in text
        assert "kvatlas_event_visibility_seconds" in text


def test_embedded_indexer_reports_and_releases_routes() -> None:
    from producer.publisher import ZmqEventPublisher
    from router_api.embedded import EmbeddedIndexer

    pub = ZmqEventPublisher("tcp://127.0.0.1:*")
    try:
        with EmbeddedIndexer(workers=[{"worker_id": "e0", "endpoint": pub.endpoint},
                                      {"worker_id": "e1", "endpoint": "tcp://127.0.0.1:9"}],
                             block_size=BS, pending_ttl_s=30.0) as idx:
            toks = list(range(1, 5 * BS))  # 4 full blocks
            assert idx.report_route(None, "a", "e1", toks) == 0  # nothing pending there before it
            assert idx.report_route(None, "b", "e1", toks[:3 * BS]) == 3  # the first route's blocks
            rows = {r.worker_id: r for r in idx.score(toks).workers}
            assert (rows["e1"].pending_blocks, rows["e0"].pending_blocks) == (4, 0)
            # in-flight load: both routes; a prefills all its tokens, b none (a's blocks are pending there)
            assert (rows["e1"].pending_requests, rows["e1"].pending_prefill_tokens) == (2, len(toks))
            assert (rows["e0"].pending_requests, rows["e0"].pending_prefill_tokens) == (0, 0)
            assert (rows["e1"].cached_blocks, rows["e1"].score, idx.score(toks).best) == (0, 0.0, None)
            assert idx.release_route(None, "a") == 4 and idx.release_route("default", "b") == 3
            assert idx.release_route(None, "a") == 0
            assert all(r.pending_blocks == r.pending_requests == r.pending_prefill_tokens == 0
                       for r in idx.score(toks).workers)
            with pytest.raises(UnknownRouteWorker):
                idx.report_route(None, "c", "nobody", toks)
    finally:
        pub.close()
