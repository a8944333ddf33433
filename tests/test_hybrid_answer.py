"""`/score` answers of hybrid models (docs/hybrid.md) written in C: a fleet of hybrid and plain workers
is scored in one C call (`hybrid_rows`: one hash, one walk of the main tree), its rows packed with a
kv_blocks column and written by `write_answer` — byte for byte what msgspec encodes from the pure
core's `score` (kv_blocks on hybrid workers' rows only), for any mix, tiers, weights and names."""
from __future__ import annotations

import random
from typing import Any

import msgspec
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.core.types import TierWeights
from indexer.index import KVIndex
from indexer.sharded import ShardedIndex
from router_api.config import ServiceConfig
from router_api.service import IndexerService
from schemas.api import RegisterWorker
from schemas.codec import encode_batch
from schemas.events import BlockRemoved, BlockStored, KVEventBatch

BS = 4
MEDIA = ("GPU", "CPU", "DISK", "EXTERNAL")
GROUPS = ((0, "full_attention", None), (1, "sliding_window", 9), (2, "mamba", None))


def services(weights: dict[str, float], names: list[str],
             sharded: bool = False) -> tuple[IndexerService, IndexerService]:
    """A native service (one index, or two worker shards) and a pure-Python one, the same workers."""
    out = []
    for native in (True, False):
        wt = TierWeights(**weights)
        index: Any = ShardedIndex(2, weights=wt) if native and sharded else KVIndex(weights=wt, native=native)
        svc = IndexerService(ServiceConfig(block_size=BS, stale_after_s=5.0), index=index, clock=lambda: 100.0)
        svc.index.ensure_model("default", BS)
        for i, name in enumerate(names):
            w = svc.registry.add(RegisterWorker(worker_id=name, endpoint=f"tcp://127.0.0.1:{3000 + i}",
                                                block_size=BS), 100.0)
            svc.index.register_worker("default", name, 0)
            if i % 3 == 1:
                w.registered_at = 0.0  # stale
        out.append(svc)
    return out[0], out[1]


def history(rng: random.Random, prompt: list[int], hybrid: bool) -> list[KVEventBatch]:
    """A worker's batches: stores of a prefix (in the three groups when hybrid), group removes."""
    out = []
    for _ in range(rng.randint(0, 4)):
        n = rng.randint(1, 12)
        medium = rng.choice(MEDIA)
        fields = dict(block_hashes=list(range(1, n + 1)), parent_block_hash=None, token_ids=prompt[:n * BS],
                      block_size=BS, medium=medium)
        if not hybrid:
            out.append(KVEventBatch(0.0, [BlockStored(**fields)]))
            continue
        evs: list[Any] = [BlockStored(**fields, group_idx=g, kv_cache_spec_kind=k, kv_cache_spec_sliding_window=w)
                          for g, k, w in GROUPS]
        if rng.random() < 0.5:  # a window or a state leaves: the usable prefix falls below the KV match
            a = rng.randrange(n)
            evs.append(BlockRemoved(list(range(a + 1, n + 1)), medium, group_idx=rng.choice([1, 2])))
        out.append(KVEventBatch(0.0, evs))
    return out


WEIGHTS = st.fixed_dictionaries({t: st.floats(-10, 10, allow_nan=False) for t in ("gpu", "host", "disk", "shared")})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(WEIGHTS, st.lists(st.booleans(), min_size=1, max_size=6), st.integers(0, 2**31), st.booleans())
def test_hybrid_answers_are_msgspecs_bytes_of_the_pure_core(weights: dict[str, float], kinds: list[bool],
                                                          seed: int, sharded: bool) -> None:
    names = [f"w{i}" for i in range(len(kinds))]
    fast, pure = services(weights, names, sharded)
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 1000) for _ in range(BS * 12)]
    for name, hybrid in zip(names, kinds):
        for b in history(rng, prompt, hybrid):
            for svc in (fast, pure):
                svc.index.apply_payload("default", name, 0, encode_batch(b))
    for q in (prompt, prompt[:BS * 3], prompt[:5], [], [9] * BS * 2):
        arr = np.asarray(q, dtype="<u4")
        for mp, enc in ((False, msgspec.json.encode), (True, msgspec.msgpack.encode)):
            want = enc(pure.score("default", q))
            assert fast.score_answer("default", arr, None, None, mp) == want
            assert fast.score_answer("default", q, None, None, mp) == want
            assert enc(fast.score("default", arr)) == want
    if any(kinds):  # a hybrid model: every answer above came from the C writer
        assert dict(fast.metrics.score_answers.items()).get(("msgspec",), 0) == 0


def test_a_mixed_fleet_is_hashed_and_walked_once(monkeypatch) -> None:
    """Hybrid and plain workers of one model: one `hybrid_rows` call per score, no `score_rows`."""
    fast, _ = services({"gpu": 1.0, "host": 0.8, "disk": 0.5, "shared": 0.4}, ["h", "p"])
    prompt = list(range(1, BS * 6 + 1))
    fast.index.apply_payload("default", "h", 0, encode_batch(KVEventBatch(0.0, [
        BlockStored([1, 2], None, prompt[:BS * 2], BS, None, "GPU", group_idx=g, kv_cache_spec_kind=k,
                    kv_cache_spec_sliding_window=w) for g, k, w in GROUPS])))
    fast.index.apply_payload("default", "p", 0, encode_batch(KVEventBatch(0.0, [
        BlockStored([1, 2, 3], None, prompt[:BS * 3], BS, None, "GPU")])))
    mod = fast.index._accel.mod
    calls: list[str] = []

    class Counting:
        def __getattr__(self, name: str) -> Any:
            fn = getattr(mod, name)
            if name not in ("hybrid_rows", "score_rows"):
                return fn

            def counted(*a: Any) -> Any:
                calls.append(name)
                return fn(*a)
            return counted
    monkeypatch.setattr(fast.index._accel, "mod", Counting())
    for mp in (False, True):
        fast.score_answer("default", np.asarray(prompt, dtype="<u4"), None, None, mp)
    rows = {s.worker_id: (s.cached_blocks, s.kv_blocks) for s in fast.index.score("default", prompt).workers}
    assert calls == ["hybrid_rows"] * 3
    assert rows == {"p": (3, None), "h": (2, 2)}
