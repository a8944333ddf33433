"""The holders' answer of `/score` (`answer: "holders"`, `top_k`; docs/reference.md, "The holders'
answer"): the full answer filtered to the rows that hold some of the query or have routes in flight, in
the same order with the same `best`, cut to its first K rows under `top_k`. Held here at widths past
1,000 workers (holder lists, spilled and dense-word values, shared-pool nodes, dp ranks, stale
workers, routes in flight), for the index (`score(holders=True)`, the C holders' walk, against the
full score filtered and the brute-force reference), the C answer writer (byte for byte msgspec's),
hybrid models, and over HTTP: 1,000 idle workers registered more do not change the answer's bytes."""
from __future__ import annotations

import random
import struct
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.core import native as native_core
from indexer.core.types import holds
from indexer.index import KVIndex
from indexer.pending import PendingRoutes
from router_api import answer
from router_api.config import ServiceConfig
from router_api.score_plan import answer_limit, in_flight
from router_api.service import IndexerService
from schemas.api import AUTO_HOLDERS_PAST, BestWorker, RegisterWorker, ScoreResponse
from schemas.codec import encode_batch
from schemas.events import BlockStored, KVEventBatch
from support.answer_cases import PROW, N, cases, columns, reference
from support.net import free_port, wait_until
from support.reference import ReferenceIndex
from test_hybrid_answer import history, services

pytestmark = pytest.mark.skipif(not native_core.available(), reason="native module not built")

ENCODINGS = ((False, msgspec.json.encode), (True, msgspec.msgpack.encode))
BS = 4
MODEL = "default"
LIMITS = (0, 1, 3)


def filtered(full: ScoreResponse, limit: int) -> ScoreResponse:
    """The holders' answer by its definition, from the full one."""
    rows = [r for r in full.workers if holds(r) or in_flight(r)]
    return ScoreResponse(full.model, full.block_size, full.query_blocks, rows[:limit] if limit else rows, full.best,
                         holders_only=True)


# --- the writer -------------------------------------------------------------------------------------

@st.composite
def writer_cases(draw: Any) -> dict[str, Any]:
    c = draw(cases())
    for r in c["rows"]:  # many rows that hold nothing, as a wide fleet's are (a zero row scores 0)
        if draw(st.booleans()):
            r.update(dev=0, cach=0, sp=[0, 0, 0, 0], score=0.0)
        elif r["dev"] or any(r["sp"]):
            r["cach"] = max(r["cach"], 1)  # a row that holds a block has a cached prefix
    # the index's order (score_walk.c rank_rows): score, then cached blocks descending, then position
    order = sorted(range(len(c["rows"])), key=lambda k: (-c["rows"][k]["score"], -c["rows"][k]["cach"], k))
    c["rows"] = [c["rows"][k] for k in order]
    pairs = [(r["wid"], r["rank"]) for r in c["rows"]] + c["extra"]
    c["pend"] = {p: (draw(st.integers(0, 3)), draw(st.integers(0, 2)), 0, draw(st.sampled_from([None, 7.5])))
                 for p in pairs if draw(st.booleans())}
    return c


def write_holders(c: dict[str, Any], mp: bool, fmts: answer.Formats, limit: int, only_holders: bool) -> bytes | None:
    """`write_answer`'s holders form as the service calls it; `only_holders`: the index's rows that hold
    nothing left out of the packed rows (what `holder_rows` gives), the positions kept."""
    rows = c["rows"]
    wids, ranks = [r["wid"] for r in rows], [r["rank"] for r in rows]
    states = [type("S", (), {"worker_id": w})() for w in c["workers"]]
    pairs = [(r["wid"], r["rank"]) for r in rows if r["wid"] in c["workers"]] + c["extra"]
    ans = answer.AnswerRows.build(states, pairs, wids, ranks)
    keep = [(k, r) for k, r in enumerate(rows)
            if not only_holders or r["dev"] or r["cach"] or any(r["sp"])]
    packed = b"".join(PROW.pack(k, r["dev"], r["cach"], *r["sp"], r["score"]) for k, r in keep)
    i = 1 if mp else 0
    pend = columns(c["pend"], ans.pairs)
    return N.write_answer(mp, fmts.holder_layouts[i], fmts.prefix(mp, c["model"], c["bs"], True), c["qb"], packed,
                          ans.heads[i], ans.wix, c["statuses"], c["seqs"], fmts.statuses[i], *pend, None, len(rows),
                          limit)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(writer_cases(), st.sampled_from(LIMITS))
def test_writer_holders_form_is_the_full_answer_filtered(c: dict[str, Any], limit: int) -> None:
    zero = {"dev": 0, "cach": 0, "sp": [0, 0, 0, 0], "score": 0.0}
    rows = c["rows"] + [{"wid": w, "rank": r, **zero} for w, r in c["extra"]]
    rows = [dict(r, pend=c["pend"].get((r["wid"], r["rank"]), (0, 0, 0, None))) for r in rows]
    full = reference(c["model"], c["bs"], c["qb"], rows, {w: i for i, w in enumerate(c["workers"])},
                     c["statuses"], c["seqs"])
    # `best` of the holders' answer is over the rows it keeps (drawn scores need not follow the counts)
    kept = [r for r in full.workers if holds(r) or in_flight(r)]
    want = filtered(full, limit)
    want.best = next((BestWorker(r.worker_id, r.dp_rank) for r in kept if not r.stale and r.score > 0), None)
    fmts = answer.Formats()
    for mp, enc in ENCODINGS:
        got = write_holders(c, mp, fmts, limit, False)
        assert got == enc(want)
        assert write_holders(c, mp, fmts, limit, True) == got
        dec = (msgspec.msgpack if mp else msgspec.json).decode(got, type=ScoreResponse)
        assert dec.holders_only and dec == want


def test_answer_limit_and_its_default() -> None:
    assert answer_limit(None, None, AUTO_HOLDERS_PAST) == -1
    assert answer_limit(None, None, AUTO_HOLDERS_PAST + 1) == 0
    assert answer_limit("full", None, 10**6) == -1
    assert answer_limit("holders", None, 1) == 0
    assert answer_limit(None, 5, 1) == answer_limit("holders", 5, 1) == 5
    with pytest.raises(ValueError):
        answer_limit("full", 5, 1)


# --- a wide fleet: the index and the service ------------------------------------------------------

WIDTH = 1100  # past 1,000 workers and past the 128-slot dense words: holder lists


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _wide(seed: int, density: str) -> tuple[IndexerService, ReferenceIndex, list[list[int]], _Clock]:
    """WIDTH workers (some with a second dp rank, the first 200 stale) fed one random stream, into a
    service's native index and the brute-force reference. density: "sparse" (a node held by a few
    workers), "dense" (prompt 0's blocks held by ~600: spilled values, dense words), "pool" (sparse,
    some stores in the shared pool, which keeps every worker in a walk)."""
    rng = random.Random(seed)
    clock = _Clock()
    svc = IndexerService(ServiceConfig(block_size=BS, stale_after_s=5.0, remove_after_s=1e9, max_workers=WIDTH + 1000),
                         index=KVIndex(native=True), clock=clock, pending=PendingRoutes(ttl_s=1e6, max_routes=64))
    svc.index.ensure_model(MODEL, BS)
    ref = ReferenceIndex()
    ref.ensure_model(MODEL, BS)
    prompts = [[rng.randrange(1, 500) for _ in range(BS * 8)] for _ in range(6)]
    for w in range(WIDTH):
        if w == 200:
            clock.t += 10.0  # the first 200 registered long ago and never heard from: stale
        name = f"w{w:05d}"
        svc.register(RegisterWorker(worker_id=name, endpoint=f"ipc:///nonexistent/kvatlas-test/w{w}", block_size=BS))
        ref.register_worker(MODEL, name, 0)
    holders = rng.sample(range(WIDTH), 40) + (list(range(0, WIDTH, 2))[:600] if density == "dense" else [])
    for w in holders:
        name = f"w{w:05d}"
        rank = 1 if w % 7 == 0 else 0
        if rank:
            svc.registry.add_rank(svc.registry.get(name), 1)
            ref.register_worker(MODEL, name, 1)
        p = prompts[0] if density == "dense" and w % 2 == 0 and rng.random() < 0.9 else rng.choice(prompts)
        n = rng.randint(1, 8)
        medium = rng.choice(["GPU", "CPU", "DISK"] + (["EXTERNAL"] if density == "pool" else []))
        hashes = [hash((tuple(p[:BS * (b + 1)]), seed)) & ((1 << 62) - 1) for b in range(n)]
        b = KVEventBatch(0.0, [BlockStored(hashes, None, p[:BS * n], BS, medium=medium)])
        with svc.lock:
            svc.index.apply_payload(MODEL, name, rank, encode_batch(b))
        ref.apply(MODEL, name, rank, b)
    return svc, ref, prompts, clock


def _row(w: Any) -> tuple:
    return (w.worker_id, w.dp_rank, w.device_blocks, w.cached_blocks, tuple(sorted(w.tiers.items())), w.score)


@pytest.mark.parametrize("density", ["sparse", "dense", "pool"])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31))
def test_wide_fleet_holders_answer(density: str, seed: int) -> None:
    svc, ref, prompts, clock = _wide(seed, density)
    rng = random.Random(seed)
    if density != "pool":  # routes in flight: rows that hold nothing but have load stay in the answer
        for i in range(6):
            svc.report_route(MODEL, f"r{i}", f"w{rng.randrange(WIDTH):05d}", prompts[i % len(prompts)],
                             busy_until=None if i % 2 else 2000.0 + i)
    queries = [p + [rng.randrange(500, 600) for _ in range(BS * 3)] for p in prompts] + [prompts[1][:BS + 1], [9] * BS]
    ix = svc.index
    for q in queries:
        arr = np.asarray(q, dtype="<u4")
        full = ix.score(MODEL, arr).workers
        got = ix.score(MODEL, arr, holders=True).workers
        want = [w for w in full if holds(w)]
        assert [_row(w) for w in got] == [_row(w) for w in want]
        assert [_row(w) for w in want] == [_row(w) for w in ref.score(MODEL, q).workers if holds(w)]
        table = ix.score_table(MODEL, arr, holders=True)
        assert table is not None and len(table.rows) == PROW.size * len(got)  # only the holders' rows
        full_answer = svc.score(MODEL, q, limit=-1)
        assert len(full_answer.workers) >= WIDTH
        for limit in LIMITS:
            want_answer = filtered(full_answer, limit)
            assert svc.score(MODEL, q, limit=limit) == want_answer
            for mp, enc in ENCODINGS:
                assert svc.score_answer(MODEL, arr, None, None, mp, limit) == enc(want_answer)
        for mp, enc in ENCODINGS:  # past AUTO_HOLDERS_PAST pairs the default answer is the holders'
            assert svc.score_answer(MODEL, arr, None, None, mp) == enc(filtered(full_answer, 0))
    assert svc.metrics.score_answers.get("msgspec") in (None, 0)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.booleans(), min_size=1, max_size=6), st.integers(0, 2**31), st.booleans(), st.sampled_from(LIMITS))
def test_hybrid_holders_answer(kinds: list[bool], seed: int, sharded: bool, limit: int) -> None:
    """A hybrid model's rows (kv_blocks; a row whose usable prefix is 0 but kv_blocks is not still holds)."""
    names = [f"w{i}" for i in range(len(kinds))]
    fast, pure = services({"gpu": 1.0, "host": 0.5, "disk": 0.25, "shared": 0.1}, names, sharded)
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 1000) for _ in range(BS * 12)]
    for name, hybrid in zip(names, kinds):
        for b in history(rng, prompt, hybrid):
            for svc in (fast, pure):
                svc.index.apply_payload(MODEL, name, 0, encode_batch(b))
    for q in (prompt, prompt[:BS * 3], [9] * BS * 2):
        arr = np.asarray(q, dtype="<u4")
        want = filtered(pure.score(MODEL, q, limit=-1), limit)
        assert pure.score(MODEL, q, limit=limit) == want
        assert [_row(w) for w in fast.index.score(MODEL, arr, holders=True).workers] == \
            [_row(w) for w in pure.index.score(MODEL, q).workers if holds(w)]
        for mp, enc in ENCODINGS:
            assert fast.score_answer(MODEL, arr, None, None, mp, limit) == enc(want)


# --- over HTTP ------------------------------------------------------------------------------------

@pytest.fixture
def http_service(tmp_path: Any) -> Any:
    """An IndexerService on the production HTTP stack (uvicorn + the /score fast path, cli/indexer.py
    `server_settings`) in a thread; its ingest is not started (the test feeds the index), so
    registrations open no subscription. Yields (service, client, a worker's endpoint by number)."""
    import threading

    import uvicorn

    from cli.indexer import server_settings
    from router_api.app import create_app

    port = free_port()
    svc = IndexerService(ServiceConfig(port=port, block_size=BS, stale_after_s=1e9, remove_after_s=1e9,
                                       max_workers=2000))
    server = uvicorn.Server(uvicorn.Config(create_app(svc), **server_settings("127.0.0.1", port)))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    wait_until(lambda: server.started, timeout=20)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30.0)
    try:
        yield svc, client, lambda n: f"ipc://{tmp_path}/w{n}"
    finally:
        client.close()
        server.should_exit = True
        t.join(timeout=20)


def test_http_holders_answer_bytes_do_not_depend_on_idle_workers(http_service: Any) -> None:
    """The holders' answer over HTTP (raw body with ?answer=holders, JSON body with `answer` / `top_k`,
    msgpack): its bytes stay the same when 1,000 more workers that hold nothing register; the full
    answer grows by their rows."""
    svc, c, endpoint = http_service
    svc.index.ensure_model(MODEL, BS)
    prompt = list(range(1, BS * 6 + 1))
    for w in range(20):
        svc.register(RegisterWorker(worker_id=f"w{w:04d}", endpoint=endpoint(w), block_size=BS))
        n = 1 + w % 6
        b = KVEventBatch(0.0, [BlockStored(list(range(1, n + 1)), None, prompt[:BS * n], BS, medium="GPU")])
        if w % 3 == 0:
            with svc.lock:
                svc.index.apply_payload(MODEL, f"w{w:04d}", 0, encode_batch(b))
    raw = np.asarray(prompt, dtype="<u4").tobytes()
    octet = {"Content-Type": "application/octet-stream"}

    def answers() -> list[bytes]:
        out = []
        for accept in ("application/json", "application/msgpack"):
            out.append(c.post("/score?answer=holders", content=raw, headers={**octet, "Accept": accept}).content)
            out.append(c.post("/score?top_k=2", content=raw, headers={**octet, "Accept": accept}).content)
            out.append(c.post("/score", json={"token_ids": prompt, "answer": "holders"},
                              headers={"Accept": accept}).content)
        return out

    before = answers()
    full_before = c.post("/score", content=raw, headers=octet).content
    dec = msgspec.json.decode(before[0], type=ScoreResponse)
    assert dec.holders_only and [r.worker_id for r in dec.workers] == [f"w{w:04d}" for w in (3, 9, 15, 0, 6, 12, 18)]
    assert len(msgspec.json.decode(before[1], type=ScoreResponse).workers) == 2
    assert before[2] == before[0]
    for w in range(20, 1020):
        svc.register(RegisterWorker(worker_id=f"w{w:04d}", endpoint=endpoint(w), block_size=BS))
    assert answers() == before
    full_after = c.post("/score?answer=full", content=raw, headers=octet).content
    assert len(msgspec.json.decode(full_before, type=ScoreResponse).workers) == 20
    assert len(msgspec.json.decode(full_after, type=ScoreResponse).workers) == 1020
    # past AUTO_HOLDERS_PAST registered pairs, the default answer is the holders'
    assert c.post("/score", content=raw, headers=octet).content == full_after
    for w in range(1020, 1020 + AUTO_HOLDERS_PAST + 1 - 1020):
        svc.register(RegisterWorker(worker_id=f"w{w:04d}", endpoint=endpoint(w), block_size=BS))
    assert c.post("/score", content=raw, headers=octet).content == before[0]
    bad = c.post("/score?answer=full&top_k=3", content=raw, headers=octet)
    assert bad.status_code == 422
    assert c.post("/score", json={"token_ids": prompt, "answer": "all"}).status_code == 422
    assert c.post("/score", json={"token_ids": prompt, "top_k": 0}).status_code == 422


def test_holders_rows_follow_membership_changes() -> None:
    """The slot → position map of the holders' walk is rebuilt when a worker comes or goes (a freed
    slot is reused by a newcomer with another position in the order)."""
    ix = KVIndex(native=True)
    ix.ensure_model(MODEL, BS)
    prompt = list(range(1, BS * 4 + 1))

    def store(name: str, n: int) -> None:
        ix.apply_payload(MODEL, name, 0, encode_batch(KVEventBatch(0.0, [
            BlockStored(list(range(1, n + 1)), None, prompt[:BS * n], BS, medium="GPU")])))

    def check() -> list[str]:
        full = ix.score(MODEL, np.asarray(prompt, dtype="<u4")).workers
        got = ix.score(MODEL, np.asarray(prompt, dtype="<u4"), holders=True).workers
        assert got == [w for w in full if holds(w)]
        return [w.worker_id for w in got]

    for w in range(300):
        ix.register_worker(MODEL, f"w{w:03d}", 0)
    store("w150", 2)
    store("w007", 4)
    assert check() == ["w007", "w150"]
    ix.remove_worker(MODEL, "w007")
    store("a-new", 3)  # takes w007's slot, first in the order
    assert check() == ["a-new", "w150"]
    store("w299", 1)
    assert check() == ["a-new", "w150", "w299"]
