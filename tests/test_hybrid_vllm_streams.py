"""Hand-built vLLM-shaped hybrid streams (full + sliding_window + mamba groups; int and bytes
hashes) against the brute-force model's usable prefix (tests/support/hybrid_model.py)."""
from __future__ import annotations

import pytest

from schemas.events import BlockRemoved, BlockStored
from support.hybrid_model import HybridModel

BS = 4
TOK = list(range(1, 25))  # 6 blocks


def ids(kind: str) -> list:
    return [1000 + i for i in range(6)] if kind == "int" else [bytes([i]) * 32 for i in range(6)]


def stored(h, parent, blocks, group, kind, medium="GPU", window=None):
    toks = [t for b in blocks for t in TOK[b * BS:(b + 1) * BS]]
    return BlockStored([h[b] for b in blocks], parent, toks, BS, None, medium, group_idx=group,
                       kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)


@pytest.mark.parametrize("hk", ["int", "bytes"])
def test_usable_prefix_of_a_three_group_stream(hk) -> None:
    h = ids(hk)
    m = HybridModel(BS)
    ev = [
        stored(h, None, range(6), 0, "full_attention"),
        stored(h, None, range(6), 1, "sliding_window", window=5),  # needs cdiv(4, 4) = 1 block
        stored(h, h[2], [3], 2, "mamba"),                            # states at blocks 3 and 5
        stored(h, h[4], [5], 2, "mamba"),
    ]
    m.apply("w", ev)
    assert m.usable("w", TOK) == (6, 6)
    m.apply("w", [BlockRemoved([h[5]], "GPU", group_idx=1)])  # window block before L=6 gone
    assert m.usable("w", TOK) == (4, 4)
    m.apply("w", [BlockRemoved([h[3]], "GPU", group_idx=2)])  # the state at block 3 gone
    assert m.usable("w", TOK) == (0, 0)
    m.apply("w", [stored(h, h[2], [3], 2, "mamba", medium="CPU_PINNED")])
    assert m.usable("w", TOK) == (0, 4)  # host-backed state: usable on any tier only
    # a remove for a group never stored is ignored, and never touches group 0
    m.apply("w", [BlockRemoved([h[0]], "GPU", group_idx=7)])
    assert m.workers["w"].ignored_removes == 1
    assert m.workers["w"].kv_blocks(TOK, BS) == 6
    # removes apply to their own group: dropping the SWA copy of block 0 leaves the KV
    m.apply("w", [BlockRemoved([h[0]], "GPU", group_idx=1)])
    assert m.workers["w"].kv_blocks(TOK, BS) == 6 and m.usable("w", TOK) == (0, 4)
