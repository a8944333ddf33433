"""`Index.apply_run` (one C call for a run of raw batches, `apply_msgpack_run`) against
`apply_payload(..., rank_from_batch=True)` batch by batch: for any stream — including byte-level
mutations of valid payloads — and any rank guess, the index ends identical and the summed counts
and drops agree. Runs in the sanitizer build too (Makefile `SAN_TESTS`)."""
from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.core.types import ApplyStats
from indexer.index import KVIndex
from schemas.codec import decode_batch, encode_batch
from schemas.events import BlockRemoved, BlockStored, KVEventBatch
from support.ingest_payloads import BS, make_payloads


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


def bytes_hashes(payloads: list[bytes], every: int) -> list[bytes]:
    """The same stream with every `every`-th engine hash (by value, so chains still link) sent as 8
    bytes, as engines with byte hashes do: those live in the maps' side dicts, the paths where the
    GIL-free run apply must take the GIL back."""
    def conv(h: object) -> object:
        return h.to_bytes(8, "big") if isinstance(h, int) and 0 < h < 1 << 64 and h % every == 0 else h

    out = []
    for p in payloads:
        b = decode_batch(p)
        if not isinstance(b, KVEventBatch):
            out.append(p)
            continue
        for e in b.events:
            if isinstance(e, (BlockStored, BlockRemoved)):
                e.block_hashes = [conv(h) for h in e.block_hashes]
            if isinstance(e, BlockStored) and e.parent_block_hash is not None:
                e.parent_block_hash = conv(e.parent_block_hash)
        out.append(encode_batch(b))
    return out


@contextmanager
def busy_thread(yielding: bool = False) -> Iterator[list[float]]:
    """Another Python thread allocating objects and stamping the time, for as long as the block runs:
    with the run apply outside the GIL, any Python object it touched without taking the GIL back
    would race this thread's allocations. `yielding`: it gives the GIL up after every stamp (so a
    caller with a long switch interval gets it back)."""
    stamps: list[float] = []
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            junk = [bytes(64) for _ in range(8)] + [{"k": i} for i in range(4)]
            del junk
            stamps.append(time.perf_counter())
            if yielding:
                time.sleep(0)  # releases the GIL: not a synchronisation, a turn for the caller
    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        yield stamps
    finally:
        stop.set()
        t.join()


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 50), odd=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
       rate=st.sampled_from([0.0, 0.0, 0.1, 0.5]), guesses=st.lists(st.integers(0, 1), min_size=1, max_size=8))
def test_apply_run_equals_batch_by_batch(seed: int, n: int, odd: float, rate: float, guesses: list[int]) -> None:
    check_run(mutate(make_payloads(seed, n, odd), random.Random(seed), rate), guesses)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 50), odd=st.sampled_from([0.0, 0.05, 0.3]),
       every=st.sampled_from([1, 2, 3]), guesses=st.lists(st.integers(0, 1), min_size=1, max_size=4))
def test_apply_run_with_byte_hashes_beside_a_busy_thread(seed: int, n: int, odd: float, every: int,
                                                         guesses: list[int]) -> None:
    payloads = bytes_hashes(make_payloads(seed, n, odd), every)
    with busy_thread():
        check_run(payloads, guesses)


def store_chain(n: int) -> list[bytes]:
    """n batches, each storing 4 blocks that continue the previous batch's (the common case; no
    clears, which take the GIL back for the rest of a call)."""
    rng = random.Random(3)
    out, parent = [], None
    for b in range(n):
        ids = [b * 4 + j + 1 for j in range(4)]
        toks = [rng.randrange(1, 50_000) for _ in range(BS * 4)]
        out.append(encode_batch(KVEventBatch(1000.0 + b, [BlockStored(ids, parent, toks, BS, None, "GPU")])))
        parent = ids[-1]
    return out


def test_apply_run_lets_other_threads_run_while_it_applies() -> None:
    payloads = store_chain(20_000)
    idx = fresh()
    windows = []
    interval = sys.getswitchinterval()
    # No forced GIL hand-over: the other thread runs only when this one gives the GIL up itself.
    sys.setswitchinterval(100.0)
    try:
        with busy_thread(yielding=True) as stamps:
            for chunk in (payloads[i:i + 2000] for i in range(0, len(payloads), 2000)):
                t0 = time.perf_counter()
                k, _, _ = idx.apply_run("m", "w", 0, 0, chunk)
                windows.append((t0, time.perf_counter()))
                assert k == len(chunk)
    finally:
        sys.setswitchinterval(interval)
    # the other thread ran inside an apply_run call (it cannot while the caller holds the GIL)
    assert any(a < s < b for a, b in windows for s in stamps)


def check_run(payloads: list[bytes], guesses: list[int]) -> None:
    n = len(payloads)
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
            assert summed([stats]) == summed(ref[i:i + k])  # a run reports what its batches did one by one
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
