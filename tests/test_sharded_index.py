"""Property tests: a worker-sharded index (indexer/sharded.py) answers exactly what one KVIndex
answers after the same histories — scores (the shared pool across shards included), per-worker tier
counts, worker lists, usable prefixes of hybrid models — on the accelerator and on the pure core,
and its dump restores (into shards or into one index) to the same answers."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from indexer.index import KVIndex
from indexer.sharded import ShardedIndex
from schemas.codec import encode_batch
from schemas.events import KVEventBatch
from support.hybrid_history import P, History, ops
from support.index_history import BS, MODEL, WORKERS, build_history, queries, run


def same_answers(got, want, prompts, rng: random.Random) -> None:
    for toks, lora, extras in queries(prompts, rng):
        for workers in (None, rng.sample(WORKERS, 2)):
            assert got.score(MODEL, toks, lora_name=lora, workers=workers, extra_keys=extras) == \
                want.score(MODEL, toks, lora_name=lora, workers=workers, extra_keys=extras), (toks, lora, workers)
            if extras is None and lora is None:
                a, b = got.score_table(MODEL, toks, workers=workers), want.score_table(MODEL, toks, workers=workers)
                assert (a is None) == (b is None)
                if a is not None:
                    assert (a.query_blocks, a.worker_ids, a.ranks, a.rows) == \
                        (b.query_blocks, b.worker_ids, b.ranks, b.rows)
    assert got.worker_stats(MODEL) == want.worker_stats(MODEL)
    assert sorted(got.workers(MODEL)) == sorted(want.workers(MODEL))


def spread(n: int) -> ShardedIndex:
    """Shards with the histories' workers "w0", "w1", "w2" placed in different shards."""
    return ShardedIndex(n, placement=lambda w: int(w[1:]) % n, native=True)


def test_placement() -> None:
    ix = ShardedIndex(3)
    ids = [f"worker-{i}" for i in range(300)]
    counts = [0, 0, 0]
    for w in ids:
        counts[ix.shard_of(w)] += 1
    assert min(counts) > 60  # the default hash spreads ids
    assert [ShardedIndex(3).shard_of(w) for w in ids] == [ix.shard_of(w) for w in ids]  # and is stable
    assert sorted({spread(3).shard_of(w) for w, _ in WORKERS}) == [0, 1, 2]
    bad = ShardedIndex(2, placement=lambda w: 5)
    with pytest.raises(ValueError, match="not a shard"):
        bad.register_worker(MODEL, "w0")


@pytest.mark.parametrize("native", [True, False], ids=["native", "pure"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_ops=st.integers(5, 120), n=st.sampled_from([2, 3]),
       via_payload=st.booleans())
def test_sharded_index_answers_like_one_index(native: bool, seed: int, n_ops: int, n: int, via_payload: bool) -> None:
    prompts, deliveries = build_history(seed, n_ops, trust=False)
    one = KVIndex(native=native)
    sharded = ShardedIndex(n, placement=lambda w: int(w[1:]) % n, native=native)
    assert sharded.native is native
    for ix in (one, sharded):
        ix.ensure_model(MODEL, BS)
    assert run(sharded, deliveries, via_payload) == run(one, deliveries, via_payload)  # same ApplyStats
    same_answers(sharded, one, prompts, random.Random(seed))
    # Snapshots: the sharded dump restores into shards, and into one index, with the same answers.
    dump = sharded.dump(MODEL)
    again = ShardedIndex(n, placement=lambda w: (int(w[1:]) + 1) % n, native=native)  # other shards
    again.load_dump(MODEL, BS, dump)
    same_answers(again, one, prompts, random.Random(seed))
    single = KVIndex(native=native)
    single.load_dump(MODEL, BS, dump)
    same_answers(single, one, prompts, random.Random(seed))


def _table(ix, toks) -> tuple | None:
    t = ix.score_table(MODEL, toks)
    return None if t is None else (t.query_blocks, t.block_size, list(t.worker_ids), list(t.ranks), t.rows)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_ops=st.integers(5, 80), n=st.sampled_from([2, 3]))
def test_table_lane_follows_every_change(seed: int, n_ops: int, n: int) -> None:
    """/score's table comes from a C call bound to the merged view (`table_lane`): queried after
    every delivery (workers joining, leaving, clearing; a model replaced by a dump), it answers what
    one KVIndex answers, and what the sharded index's general path answers for the same query."""
    prompts, deliveries = build_history(seed, n_ops, trust=False)
    one, sharded = KVIndex(native=True), spread(n)
    for ix in (one, sharded):
        ix.ensure_model(MODEL, BS)
    probes = [toks for toks, _ in prompts][:4] + [[1, 2, 3, 4, 5, 6, 7, 8]]
    for toks in probes:  # an empty model first (a history may deliver nothing)
        assert _table(sharded, toks) == _table(one, toks)
    for d in deliveries:
        run(one, [d])
        run(sharded, [d])
        for toks in probes:
            lane = _table(sharded, toks)
            assert lane == _table(one, toks), (d[0], toks)
            general = sharded.shards[0].score_table_model(sharded._view(MODEL), toks, None, None, None)
            assert lane == (None if general is None else (general.query_blocks, general.block_size,
                            list(general.worker_ids), list(general.ranks), general.rows))
    # the lane served (a model with group tables, from a history's multimodal stores, takes the general path)
    assert bool(sharded._lanes) == all(s.model_state(MODEL).groups is None for s in sharded.shards)
    sharded.load_dump(MODEL, BS, sharded.dump(MODEL))  # new model objects: the lane must not outlive them
    for toks in probes:
        assert _table(sharded, toks) == _table(one, toks)
    sharded.drop_model(MODEL)
    with pytest.raises(KeyError):
        sharded.score_table(MODEL, probes[0])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["mamba", "swa", "dsa"]), opt_in=st.booleans(), seqs=st.lists(ops(30), min_size=3,
       max_size=3), seed=st.integers(0, 2**16))
def test_hybrid_models_score_like_one_index(family, opt_in, seqs, seed) -> None:
    """Three producers (their own histories) whose workers land in different shards."""
    hs = [History(family, opt_in, seed + i) for i in range(3)]
    wids = ["w0", "w1", "w2"]
    one, sharded = KVIndex(native=True), spread(3)
    for ix in (one, sharded):
        ix.ensure_model(MODEL, P)
    try:
        for step in range(max(len(s) for s in seqs)):
            asked = []
            for h, wid, seq in zip(hs, wids, seqs):
                if step >= len(seq):
                    continue
                tokens, events = h.step(*seq[step])
                asked.append(tokens)
                batch = KVEventBatch(h.now, events)
                if batch.events:
                    for ix in (one, sharded):
                        ix.apply_payload(MODEL, wid, 0, encode_batch(batch))
            for t in asked + [b for h in hs for b in h.bases]:
                assert sharded.score(MODEL, t) == one.score(MODEL, t), (t, family, opt_in)
        assert sharded.worker_stats(MODEL) == one.worker_stats(MODEL)
    finally:
        for h in hs:
            h.close()


def test_trust_mode_is_refused_with_more_than_one_shard() -> None:
    with pytest.raises(ValueError, match="trust_engine_hashes"):
        ShardedIndex(2, trust_engine_hashes=True)
    ix = ShardedIndex(2)
    with pytest.raises(ValueError, match="trust_engine_hashes"):
        ix.ensure_model(MODEL, BS, trust_engine_hashes=True)
    ShardedIndex(1, trust_engine_hashes=True)  # one shard is one index: allowed
    with pytest.raises(ValueError):
        ShardedIndex(0)

