"""Group residency bytes follow what is held (issue 38): the sliding-window and Mamba groups' maps
(`U64Map.sparse`) are kept a third full while small (short probes for churning windows) and two
thirds full once big, so a hybrid stream that keeps every block in every group (vLLM's group shape)
costs about the main tree's bytes per group, not 2.5x."""
from __future__ import annotations

import random

import pytest

from indexer.core import native
from indexer.index import KVIndex
from schemas.codec import encode_batch
from schemas.events import BlockRemoved, BlockStored, KVEventBatch

N = native.select(None)
pytestmark = pytest.mark.skipif(N is None, reason="the C accelerator is not built")
BS = 4


def test_a_sparse_map_is_a_third_full_while_small_and_two_thirds_when_big() -> None:
    rng = random.Random(0)
    small, big = N.U64Map.sparse(), N.U64Map.sparse()
    keys = rng.sample(range(1, 1 << 62), 200_000)
    for k in keys[:1000]:
        small[k] = k & 0xFFFF
    for k in keys:
        big[k] = k & 0xFFFF
    slot = 16  # one key word and one value word
    assert small.nbytes > 3 * 1000 * slot  # at most a third full
    assert big.nbytes < 2.4 * len(keys) * slot  # at most two thirds full, after a 1.5x step at worst
    for k in keys[::2]:  # deletes and lookups at the higher load
        del big[k]
    assert all(big.get(k) == (None if i % 2 == 0 else k & 0xFFFF) for i, k in enumerate(keys[:5000]))
    assert len(big) == len(keys) // 2


def test_resident_groups_cost_about_the_main_trees_bytes() -> None:
    """Every block stored in a full-attention, a sliding-window and a Mamba group on 4 workers: each
    other group's node table and worker maps take under 1.8x the main tree's (a third full: 2.25-3.4x);
    the answers stay the usable prefix (and the windows' removes still apply)."""
    ix = KVIndex(native=True)
    ix.ensure_model("m", BS)
    rng = random.Random(1)
    docs = []
    for w in range(4):
        for d in range(40):
            toks = [rng.randrange(1, 50_000) for _ in range(BS * 200)]
            docs.append((w, toks))
            hs = [w * 10_000_000 + d * 1000 + i + 1 for i in range(200)]
            evs = [BlockStored(hs, None, toks, BS, None, "GPU", group_idx=g, kv_cache_spec_kind=k,
                               kv_cache_spec_sliding_window=win)
                   for g, k, win in ((0, "full_attention", None), (1, "sliding_window", 64), (2, "mamba", None))]
            if d % 4 == 0:  # a window leaving: the usable prefix falls back to the blocks below it
                evs.append(BlockRemoved(hs[100:], "GPU", group_idx=1))
            ix.apply_payload("m", f"w{w}", 0, encode_batch(KVEventBatch(0.0, evs)))
    m = ix._models["m"]
    main_nodes = m.nodes.nbytes
    main_maps = sum(w.ext.nbytes for w in m.by_id.values())
    for g in m.groups.classes.values():
        assert g.nodes.nbytes < 1.8 * main_nodes
        assert sum(e.nbytes for e in g.ext.values()) < 1.8 * main_maps
    for i, (w, toks) in enumerate(docs[:40]):
        row = next(s for s in ix.score("m", toks).workers if s.worker_id == f"w{w}")
        assert (row.cached_blocks, row.kv_blocks) == ((100 if i % 4 == 0 else 200), 200)
