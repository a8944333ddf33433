"""Wide fleets (more worker slots than the residency table's exact widths, docs/scaling.md "The index
at scale"): the native walk, which follows only the workers still in it, and its ranking, which sorts
only rows with a block, give the pure core's answers exactly, row for row and in order, for one index
and a worker-sharded one, with any tier weights (a row with no block scores 0.0, or -0.0 when every
weight is negative); the packed rows are the same rows; the residency table's width stays on its
ladder as workers come and go (a group's dense table) or, for a main tree past 128 slots, turns to holder
lists (U64Map.holders, holders.c) and back, and a restore ends in the form growing to it reached."""
from __future__ import annotations

import math
import random
import struct

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from indexer.core import native as native_core
from indexer.core.types import TierWeights
from indexer.index import KVIndex
from indexer.sharded import ShardedIndex
from schemas.codec import encode_batch
from schemas.events import BlockRemoved, BlockStored, KVEventBatch

pytestmark = pytest.mark.skipif(not native_core.available(), reason="accelerator not built")

MODEL, BS = "m", 4
MEDIA = ["GPU", "CPU", "DISK", "EXTERNAL"]  # EXTERNAL: the shared pool (keeps every worker in a walk)
WEIGHTS = [TierWeights(), TierWeights(1.0, -0.5, 0.0, 2.0), TierWeights(-1.0, -0.8, -0.5, -0.4)]
PROW = struct.Struct("<7qd")  # score_walk.c PRow: slot, device, cached, 4 tiers, score


def ladder(need: int) -> int:
    """u64map.c's widths: exact up to 8 words, then steps 1/4 wider (rounded up)."""
    w = 8 if need > 8 else need
    while w < need:
        w += (w + 3) // 4
    return w


def history(seed: int, n_workers: int) -> tuple[list[tuple[str, bytes]], list[list[int]]]:
    """Payloads of chained documents (a document may continue another's prefix, so holders thin out
    along a walk) stored on random tiers by random workers, some removed again; and queries."""
    rng = random.Random(seed)
    docs: list[list[int]] = []
    for _ in range(12):
        base = list(rng.choice(docs)[: BS * rng.randint(1, 3)]) if docs and rng.random() < 0.6 else []
        docs.append(base + [rng.randrange(1, 50_000) for _ in range(BS * rng.randint(1, 5))])
    pays = []
    for _ in range(n_workers * 2):
        wid = f"w{rng.randrange(n_workers):04d}"
        d = rng.choice(docs)
        n = rng.randint(1, len(d) // BS)
        toks = d[: n * BS]
        medium = rng.choice(MEDIA) if rng.random() < 0.3 else "GPU"
        if medium == "EXTERNAL" and rng.random() < 0.7:
            medium = "GPU"  # the pool stays rare: most walks end where the holders do
        hashes = [hash((tuple(toks[: (i + 1) * BS]), medium)) & (2**63 - 1) or 1 for i in range(n)]
        evs: list = [BlockStored(hashes, None, toks, BS, medium=medium)]
        if rng.random() < 0.15:
            evs.append(BlockRemoved(hashes[rng.randrange(n):], medium=medium))
        pays.append((wid, encode_batch(KVEventBatch(0.0, evs))))
    queries = [d + [rng.randrange(1, 50_000) for _ in range(BS * 2)] for d in docs] + [docs[0][:BS]]
    return pays, queries


def rows(res) -> list[tuple]:
    # repr of the score: 0.0 and -0.0 are different answers on the wire
    return [(w.worker_id, w.dp_rank, w.device_blocks, w.cached_blocks, tuple(w.tiers.items()), repr(w.score))
            for w in res.workers]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(seed=14961, n_workers=150, wi=0)  # its last slot holds no block: a restore is narrower
@given(seed=st.integers(0, 2**32 - 1), n_workers=st.sampled_from([150, 400, 1200]), wi=st.integers(0, len(WEIGHTS) - 1))
def test_wide_walk_and_ranking_match_the_pure_core(seed: int, n_workers: int, wi: int) -> None:
    w = WEIGHTS[wi]
    pays, queries = history(seed, n_workers)
    fast, pure, sharded = KVIndex(w, native=True), KVIndex(w, native=False), ShardedIndex(3, weights=w)
    for ix in (fast, pure, sharded):
        ix.ensure_model(MODEL, BS)
        for wid, p in pays:
            ix.apply_payload(MODEL, wid, 0, p)
    m = fast._models[MODEL]
    # past 8 words (128 slots): holder lists, two words a value
    assert m.nodes.form == ("lists" if len(m.workers) > 128 else "dense")
    for q in queries:
        want = rows(pure.score(MODEL, q))
        assert rows(fast.score(MODEL, q)) == want
        assert rows(sharded.score(MODEL, q)) == want
        t = fast.score_table(MODEL, q)
        packed = [PROW.unpack_from(t.rows, i) for i in range(0, len(t.rows), PROW.size)]
        assert [(t.worker_ids[p[0]], t.ranks[p[0]], p[1], p[2], p[3:7], repr(p[7])) for p in packed] == \
            [(r[0], r[1], r[2], r[3], tuple(v for _, v in r[4]), r[5]) for r in want]
        some = [(f"w{i:04d}", 0) for i in range(0, n_workers, 7)]
        assert rows(fast.score(MODEL, q, workers=some)) == rows(pure.score(MODEL, q, workers=some))
    # a restore lays the table out once, in the form its highest holding slot needs: holder lists past
    # 128 slots, dense words on the ladder below (seed 14961, 150 workers: its last slots hold nothing)
    back = KVIndex(w, native=True)
    back.load_dump(MODEL, BS, fast.dump(MODEL))
    nodes = back._models[MODEL].nodes
    top = max(w.slot for w in back._models[MODEL].workers if w is not None and w.ext)
    assert nodes.form == ("lists" if top >= 128 else "dense")
    assert nodes.form == "lists" or nodes.width == ladder(nodes.width)
    assert [rows(back.score(MODEL, q)) for q in queries] == [rows(pure.score(MODEL, q)) for q in queries]


def test_dense_width_follows_the_ladder() -> None:
    """A dense table (a full-attention group's, `U64Map()`) widens on the ladder and narrows onto it."""
    from indexer._native import _kvnative as kvn

    m = kvn.U64Map()
    seen = set()
    for i in range(700):  # 700 slots: 44 words needed, 44 on the ladder (8, 10, 13, 17, 22, 28, 35, 44)
        m[7] = m.get(7, 0) | 1 << (4 * i)
        seen.add(m.width)
    assert seen == {1, 2, 3, 4, 5, 6, 7, 8, 10, 13, 17, 22, 28, 35, 44} and m.form == "dense"
    m[7] &= (1 << (4 * 300)) - 1
    assert m.narrow() == ladder(math.ceil(300 * 4 / 64)) == 22


def test_main_tree_turns_to_holder_lists_and_back_as_workers_come_and_go() -> None:
    ix = KVIndex(native=True)
    ix.ensure_model(MODEL, BS)
    pay = encode_batch(KVEventBatch(0.0, [BlockStored([7], None, [1, 2, 3, 4], BS, medium="GPU")]))
    m = ix._models[MODEL]
    seen = set()
    for i in range(700):
        ix.apply_payload(MODEL, f"w{i:04d}", 0, pay)
        seen.add((m.nodes.form, m.nodes.width))
    # dense words up to 8 (128 slots), then holder lists: one node held by 700 workers is dense words
    # inside its block (widely held); the table stays two words wide
    assert seen == {("dense", w) for w in range(1, 9)} | {("lists", 2)}
    for i in range(300, 700):
        ix.remove_worker(MODEL, f"w{i:04d}")
    assert m.nodes.form == "lists"  # 300 slots still held
    assert [w.cached_blocks for w in ix.score(MODEL, [1, 2, 3, 4]).workers] == [1] * 300
    for i in range(100, 300):
        ix.remove_worker(MODEL, f"w{i:04d}")
    assert (m.nodes.form, m.nodes.width) == ("dense", ladder(math.ceil(100 * 4 / 64))) == ("dense", 7)
    assert [w.cached_blocks for w in ix.score(MODEL, [1, 2, 3, 4]).workers] == [1] * 100
