"""`Index.apply_run` (one C call for a run of raw batches, `apply_msgpack_run`) against
`apply_payload(..., rank_from_batch=True)` batch by batch: for any stream — including byte-level
mutations of valid payloads — and any rank guess, the index ends identical and the summed counts
and drops agree. Runs in the sanitizer build too (Makefile `SAN_TESTS`)."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.core.types import ApplyStats
from indexer.index import KVIndex
from test_ingest_runs import BS, make_payloads


def mutate(payloads: list[bytes], rng: random.Random, rate: float) -> list[bytes]:
    out = []
    for p in payloads:
        if p and rng.random() < rate:
            b = bytearray(p)
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            if rng.random() < 0.3:
                b = b[: rng.randrange(len(b) + 1)]
            p = bytes(b)
        out.append(p)
    return out


def fresh() -> KVIndex:
    idx = KVIndex(native=True)
    idx.ensure_model("m", BS)
    idx.register_worker("m", "w", 0)
    return idx


def summed(stats: list[ApplyStats]) -> tuple[dict, dict]:
    counts: dict = {}
    drops: dict = {}
    for s in stats:
        for k, v in s.counts.items():
            counts[k] = counts.get(k, 0) + v
        for k, v in s.drops.items():
            drops[k] = drops.get(k, 0) + v
    return counts, drops


def state(idx: KVIndex) -> tuple:
    return (sorted((w, r, sorted(map(repr, evs))) for w, r, evs in idx.dump("m")), idx.worker_stats("m"),
            idx.workers("m"))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 50), odd=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
       rate=st.sampled_from([0.0, 0.0, 0.1, 0.5]), guesses=st.lists(st.integers(0, 1), min_size=1, max_size=8))
def test_apply_run_equals_batch_by_batch(seed: int, n: int, odd: float, rate: float, guesses: list[int]) -> None:
    payloads = mutate(make_payloads(seed, n, odd), random.Random(seed), rate)
    one = fresh()
    ref = [one.apply_payload("m", "w", 0, p, rank_from_batch=True) for p in payloads]
    run = fresh()
    got: list[ApplyStats] = []
    i = c = 0
    while i < n:
        k, stats, extra = run.apply_run("m", "w", guesses[c % len(guesses)], 0, payloads[i:])
        c += 1
        assert 0 <= k <= n - i
        if k:
            assert sum(stats.counts.values()) + sum(stats.drops.values()) >= 0
            got.append(stats)
            i += k
        if i < n:
            got.append(extra if extra is not None else run.apply_payload("m", "w", 0, payloads[i], rank_from_batch=True))
            i += 1
    assert state(run) == state(one)
    assert summed(got) == summed(ref)
    m = run._models["m"]
    for w in m.by_id.values():  # worker_stats' C count against the pure core's
        assert run._accel.tier_counts(m, w) == m.tier_counts(w)


def test_tier_counts_count_a_block_named_by_two_engine_hashes_once() -> None:
    from producer.page_hash import page_ids
    from schemas.codec import encode_batch
    from schemas.events import BlockStored, KVEventBatch

    idx = fresh()
    toks = list(range(1, 1 + 3 * BS))
    ids = page_ids(toks, BS)
    other = [i + 1 for i in ids]  # another engine's hashes for the same blocks
    for hs, medium in ((ids, "GPU"), (other, "GPU"), (other, "DISK")):
        idx.apply_payload("m", "w", 0, encode_batch(KVEventBatch(1.0, [BlockStored(hs, None, toks, BS, None, medium)])))
    m = idx._models["m"]
    w = m.by_id[("w", 0)]
    assert len(w.ext) == 6
    assert idx._accel.tier_counts(m, w) == m.tier_counts(w) == [3, 0, 3, 0]
    assert idx.worker_stats("m")[("w", 0)] == {"gpu": 3, "host": 0, "disk": 3, "shared": 0}
