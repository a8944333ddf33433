"""The /score answer bytes written in C (`write_answer`, router_api/answer.py) against msgspec encoding
the ScoreResponse the Python path builds: byte for byte, JSON and msgpack, over hypothesis-drawn
scores (odd floats: subnormals, -0.0, 1e16, 1e-5, ...), tiers, statuses, last_seqs, worker ids and
model names (unicode, quotes, control characters), unregistered index rows and registered pairs the
index does not hold. Then whole services: the native service's answer against a pure-Python
service's fed the same events with odd tier weights, and through the HTTP front."""
from __future__ import annotations

import random
import struct
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.core import native as native_core
from indexer.index import KVIndex, TierWeights
from router_api import answer
from router_api.app import create_app
from router_api.config import ServiceConfig
from router_api.service import IndexerService
from schemas.api import RegisterWorker
from schemas.codec import encode_batch
from schemas.events import BlockStored, KVEventBatch
from support.answer_cases import N, ODD_FLOATS, PROW, SCORES, cases, reference, write

pytestmark = pytest.mark.skipif(not native_core.available(), reason="native module not built")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_written_answer_is_msgspecs(c: dict[str, Any]) -> None:
    fmts = answer.Formats()
    pos = {w: i for i, w in enumerate(c["workers"])}
    rows = c["rows"] + [{"wid": w, "rank": r, "dev": 0, "cach": 0, "sp": [0, 0, 0, 0], "score": 0.0}
                        for w, r in c["extra"]]
    ref = reference(c["model"], c["bs"], c["qb"], rows, pos, c["statuses"], c["seqs"])
    for mp, enc in ((False, msgspec.json.encode), (True, msgspec.msgpack.encode)):
        assert write(c, mp, fmts) == enc(ref)


@settings(max_examples=3000, deadline=None)
@given(st.one_of(SCORES, st.integers(0, 2**64 - 1).map(lambda b: struct.unpack("<d", struct.pack("<Q", b))[0])))
def test_any_finite_score_is_spelled_like_msgspec(score: float) -> None:
    """msgspec's JSON float spelling (shortest round-trip digits; decimals for 1e-5 <= |x| < 1e16,
    exponents outside) for any bit pattern; a non-finite score defers to msgspec (None)."""
    c = {"model": "m", "bs": 1, "qb": 1, "workers": ["w"], "rows": [
        {"wid": "w", "rank": 0, "dev": 1, "cach": 1, "sp": [1, 0, 0, 0], "score": score}], "extra": [],
        "statuses": ["live"], "seqs": [7]}
    fmts = answer.Formats()
    for mp, enc in ((False, msgspec.json.encode), (True, msgspec.msgpack.encode)):
        got = write(c, mp, fmts)
        if not np.isfinite(score):
            assert got is None
            continue
        ref = reference("m", 1, 1, [dict(c["rows"][0])], {"w": 0}, ["live"], [7])
        assert got == enc(ref)


def test_writer_defers_what_it_does_not_know() -> None:
    fmts = answer.Formats()
    base = {"model": "m", "bs": 1, "qb": 1, "workers": ["w"], "rows": [
        {"wid": "w", "rank": 0, "dev": 1, "cach": 1, "sp": [1, 0, 0, 0], "score": 1.0}], "extra": [],
        "statuses": ["live"], "seqs": [7]}
    assert write(base, False, fmts) is not None
    assert write({**base, "statuses": ["sleeping"]}, False, fmts) is None  # a status outside the vocabulary
    assert write({**base, "seqs": [2**64]}, True, fmts) is None  # a last_seq beyond int64
    assert write({**base, "seqs": ["7"]}, True, fmts) is None  # not an int
    # malformed inputs never read out of bounds: rows naming a slot past the heads, short wix
    lay, pre = fmts.layouts[0], fmts.prefix(False, "m", 1)
    bad_row = PROW.pack(5, 1, 1, 1, 0, 0, 0, 1.0)
    assert N.write_answer(False, lay, pre, 1, bad_row, (b'"worker_id":"w","dp_rank":0',), struct.pack("<i", 0),
                          ["live"], [1], fmts.statuses[0]) is None
    assert N.write_answer(False, lay, pre, 1, b"", (b"x",), b"", ["live"], [1], fmts.statuses[0]) is None
    assert N.write_answer(False, lay, pre, 1, b"", (b"x",), struct.pack("<i", 3), ["live"], [1],
                          fmts.statuses[0]) is None
    assert N.write_answer(False, lay[:-1], pre, 1, b"", (), b"", [], [], fmts.statuses[0]) is None


# --- whole services -------------------------------------------------------------------------------

BS = 4
MEDIA = ("GPU", "CPU", "DISK", "EXTERNAL")


def services(weights: dict[str, float], names: list[str]) -> tuple[IndexerService, IndexerService]:
    """A native service and a pure-Python one, the same workers registered in both."""
    out = []
    for native in (True, False):
        cfg = ServiceConfig(block_size=BS, stale_after_s=5.0)
        svc = IndexerService(cfg, index=KVIndex(weights=TierWeights(**weights), native=native), clock=lambda: 100.0)
        svc.index.ensure_model("default", BS)
        for i, name in enumerate(names):
            w = svc.registry.add(RegisterWorker(worker_id=name, endpoint=f"tcp://127.0.0.1:{3000 + i}",
                                                block_size=BS), 100.0)
            svc.index.register_worker("default", name, 0)
            if i % 3 == 1:  # stale: silent for longer than its deadline
                w.registered_at = 0.0
            elif i % 3 == 2:
                w.last_msg_at, w.last_seq = 99.0, i * 1000
        out.append(svc)
    return out[0], out[1]


WEIGHTS = st.fixed_dictionaries({t: st.one_of(ODD_FLOATS, st.floats(-1e6, 1e6, allow_nan=False))
                                 for t in ("gpu", "host", "disk", "shared")})
WORKER_IDS = st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs", "Zs", "Zl", "Zp", "Cn"),
                                                     blacklist_characters='/\\?#%"\''), min_size=1, max_size=8),
                      min_size=1, max_size=5, unique=True).filter(lambda ns: all(n.isprintable() for n in ns))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(WEIGHTS, WORKER_IDS, st.integers(0, 2**31))
def test_native_service_answers_the_pure_services_bytes(weights: dict[str, float], names: list[str],
                                                        seed: int) -> None:
    fast, pure = services(weights, names)
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 1000) for _ in range(BS * 12)]
    for svc in (fast, pure):
        r2 = random.Random(seed)
        for name in names:
            for _ in range(r2.randint(0, 3)):
                n = r2.randint(1, 12)
                toks = prompt[: n * BS]
                ev = BlockStored(block_hashes=list(range(1, n + 1)), parent_block_hash=None, token_ids=toks,
                                 block_size=BS, medium=r2.choice(MEDIA))
                svc.index.apply_payload("default", name, 0, encode_batch(KVEventBatch(0.0, [ev])))
    assert fast._writer is not None and fast.index.native and not pure.index.native
    for q in (prompt, prompt[: BS * 3], prompt[:5], [], [9] * BS * 2):
        arr = np.asarray(q, dtype="<u4")
        for mp, enc in ((False, msgspec.json.encode), (True, msgspec.msgpack.encode)):
            want = enc(pure.score("default", q))
            assert pure.score_answer("default", q, None, None, mp) == want  # the msgspec fallback
            assert fast.score_answer("default", arr, None, None, mp) == want
            assert fast.score_answer("default", q, None, None, mp) == want
            assert enc(fast.score("default", arr)) == want


def test_registered_pairs_the_index_lacks_and_strangers() -> None:
    """Rows for registered ranks the index has not seen (zero rows) and index rows of no registered
    worker (left out), through the C path and the reference path alike."""
    fast, pure = services({"gpu": 1.0, "host": 0.8, "disk": 0.5, "shared": 0.4}, ["a", "b", "c"])
    for svc in (fast, pure):
        svc.registry.add_rank(svc.registry.get("a"), 1)  # ranks registered, never seen by the index
        svc.registry.add_rank(svc.registry.get("a"), 2)
        svc.index.register_worker("default", "ghost", 0)  # held by the index, not registered
        toks = list(range(1, BS * 4 + 1))
        ev = BlockStored(block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=toks, block_size=BS, medium="CPU")
        svc.index.apply_payload("default", "b", 0, encode_batch(KVEventBatch(0.0, [ev])))
    for mp, enc in ((False, msgspec.json.encode), (True, msgspec.msgpack.encode)):
        want = enc(pure.score("default", list(range(1, BS * 4 + 1))))
        assert fast.score_answer("default", np.arange(1, BS * 4 + 1, dtype="<u4"), None, None, mp) == want
        assert b"ghost" not in want


def test_http_front_answers_the_same_bytes() -> None:
    fast, _ = services({"gpu": 1.0, "host": 0.8, "disk": 0.5, "shared": 0.4}, ["w0", "wé", "w\u4e2d"])
    toks = list(range(1, BS * 6 + 1))
    ev = BlockStored(block_hashes=list(range(1, 7)), parent_block_hash=None, token_ids=toks, block_size=BS, medium="GPU")
    fast.index.apply_payload("default", "wé", 0, encode_batch(KVEventBatch(0.0, [ev])))
    front = create_app(fast)
    route = front.routes["/score"]
    want_json = msgspec.json.encode(fast.score("default", toks))
    want_mp = msgspec.msgpack.encode(fast.score("default", toks))
    body = msgspec.json.encode({"token_ids": toks})
    assert front.answer(route, "json", None, b"", body, 0.0)[1] == want_json
    assert front.answer(route, "msgpack", b"application/msgpack", b"", msgspec.msgpack.encode({"token_ids": toks}),
                        0.0)[1] == want_mp
    assert front.answer(route, "octet", b"application/msgpack", b"", np.asarray(toks, "<u4").tobytes(), 0.0)[1] \
        == want_mp
    status, out, _ = front.answer(route, "json", None, b"", b'{"token_ids": [1], "model": "nope"}', 0.0)
    assert status == 404 and b"unknown model" in out


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.lists(st.integers(0, 2**32 - 1), max_size=300), st.integers(0, 2**64 - 1))
def test_u32_token_buffers_hash_like_the_reference(bs: int, toks: list[int], seed: int) -> None:
    """score_rows hashes a u32 buffer in place (4 tokens at a time where the CPU has AVX2, any tail
    scalar): the same chained keys as the pure-Python hashing, for every block size."""
    from indexer import hashing as H

    keys = H.chain_keys_py(toks, bs, seed)
    nodes = N.U64Map()
    for k in keys:
        nodes[k] = 1  # slot 0 on GPU: every matching block counts
    res = N.score_rows(nodes, None, np.asarray(toks, dtype="<u4"), seed, bs, [0], ["w"], [0],
                       (1.0, 1.0, 1.0, 1.0), None, ("gpu", "host", "disk", "shared"))
    depth = struct.unpack_from("<7qd", res[1])[2] if res is not None else None
    if 0 in keys:
        assert res is None  # key 0 lives in the side dict: the Python walk judges it
    else:
        assert res[0] == len(keys) and depth == len(keys)


def test_membership_changes_between_queries() -> None:
    """The cached per-plan pieces (registry plan, the index order it was last seen with) follow every
    change: index-only workers, registry-only ranks, registration and removal between two queries."""
    fast, pure = services({"gpu": 1.0, "host": 0.8, "disk": 0.5, "shared": 0.4}, ["a", "b"])
    toks = list(range(1, BS * 4 + 1))
    ev = BlockStored(block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=toks, block_size=BS, medium="GPU")

    def check() -> None:
        for mp, enc in ((False, msgspec.json.encode), (True, msgspec.msgpack.encode)):
            want = enc(pure.score("default", toks))
            assert fast.score_answer("default", np.asarray(toks, dtype="<u4"), None, None, mp) == want
            assert fast.score_answer("default", np.asarray(toks, dtype="<u4"), None, None, mp) == want

    for svc in (fast, pure):
        svc.index.apply_payload("default", "b", 0, encode_batch(KVEventBatch(0.0, [ev])))
    check()
    changes = [
        lambda svc: svc.index.register_worker("default", "ghost", 0),  # held by the index only
        lambda svc: svc.index.remove_worker("default", "ghost"),
        lambda svc: svc.registry.add_rank(svc.registry.get("a"), 3),  # a rank the index has not seen
        lambda svc: svc.index.register_worker("default", "a", 3),
        lambda svc: svc.register(RegisterWorker(worker_id="c", endpoint="tcp://127.0.0.1:3999", block_size=BS)),
        lambda svc: svc.index.apply_payload("default", "c", 0, encode_batch(KVEventBatch(0.0, [ev]))),
        lambda svc: svc.unregister("b"),
    ]
    for change in changes:
        for svc in (fast, pure):
            change(svc)
        check()


def test_a_new_rank_reaches_the_cached_plan() -> None:
    """The score plan is kept while the ranks version holds: every new rank moves it (`Registry.add_rank`, the
    only way to grow `dp_ranks`: a frozenset), so the next answer lists the rank, and a rank already
    held moves nothing."""
    fast, _ = services({"gpu": 1.0, "host": 0.8, "disk": 0.5, "shared": 0.4}, ["a", "b"])
    arr = np.arange(1, BS * 2 + 1, dtype="<u4")

    def rows() -> set[tuple[str, int]]:
        ans = msgspec.json.decode(fast.score_answer("default", arr, None, None, False))
        return {(w["worker_id"], w["dp_rank"]) for w in ans["workers"]}

    assert rows() == {("a", 0), ("b", 0)}
    w = fast.registry.get("a")
    with pytest.raises(AttributeError):
        w.dp_ranks.add(5)  # type: ignore[attr-defined]
    v = fast.registry.ranks_version
    fast.registry.add_rank(w, 0)
    assert fast.registry.ranks_version == v  # held already: the plan stays
    fast.registry.add_rank(w, 4)
    assert fast.registry.ranks_version != v
    assert rows() == {("a", 0), ("a", 4), ("b", 0)}
