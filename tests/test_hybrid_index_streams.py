"""Hybrid-aware indexing (docs/hybrid.md, "The indexer"): hand-built vLLM-shaped streams (full +
sliding_window + mamba groups, int and bytes hashes) through KVIndex on both cores and the brute-force
reference, against the usable prefix of tests/support/hybrid_model.py; group removes; dumps; random
group histories held to the reference; full-attention-only models answered exactly as before."""
from __future__ import annotations

import random
from typing import Any

import pytest

from indexer.index import KVIndex
from schemas.codec import encode_batch
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from support.hybrid_model import HybridModel
from support.reference import ReferenceIndex

BS = 4
M = "m"
TOK = list(range(1, 25))  # 6 blocks


def make(kind: str) -> Any:
    """An index; KVIndex drops orphans at the end of their batch, like the reference does at once."""
    if kind == "reference":
        r: Any = ReferenceIndex()
    else:
        r = KVIndex(native=kind == "native", orphan_grace_batches=0)
    r.ensure_model(M, BS)
    return r


@pytest.fixture(params=["native", "pure", "reference"])
def ix(request) -> Any:
    return make(request.param)


@pytest.fixture(params=["apply", "payload"])
def feed(request):
    def go(ix: Any, wid: str, events: list) -> None:
        b = KVEventBatch(0.0, events)
        if request.param == "apply":
            ix.apply(M, wid, 0, b)
        else:
            ix.apply_payload(M, wid, 0, encode_batch(b))
    return go


def ids(kind: str) -> list:
    return [1000 + i for i in range(6)] if kind == "int" else [bytes([i + 1]) * 32 for i in range(6)]


def stored(h, blocks, group, kind, medium="GPU", window=None, parent=None) -> BlockStored:
    blocks = list(blocks)
    if parent is None and blocks[0] > 0:
        parent = h[blocks[0] - 1]
    toks = [t for b in blocks for t in TOK[b * BS:(b + 1) * BS]]
    return BlockStored([h[b] for b in blocks], parent, toks, BS, None, medium, group_idx=group,
                       kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)


def row(ix: Any, toks: list[int] = TOK, wid: str = "w") -> tuple:
    s = next(s for s in ix.score(M, toks).workers if s.worker_id == wid)
    return s.device_blocks, s.cached_blocks, s.kv_blocks, tuple(s.tiers.values())


@pytest.mark.parametrize("hk", ["int", "bytes"])
def test_sliding_window_removes_leave_the_kv(ix, feed, hk) -> None:
    """vLLM evicts SWA blocks that leave the window: those removes name group 1 and must not drop the
    full-attention block with the same hash (which an index ignoring group_idx does)."""
    h = ids(hk)
    feed(ix, "w", [stored(h, range(6), 0, "full_attention"),
                   stored(h, range(6), 1, "sliding_window", window=5)])  # window: cdiv(4, 4) = 1 block
    feed(ix, "w", [BlockRemoved(h[:5], "GPU", group_idx=1)])
    assert row(ix) == (6, 6, 6, (6, 0, 0, 0))
    assert row(ix, TOK[:20]) == (0, 0, 5, (0, 0, 0, 0))  # every L <= 5 needs an evicted SWA block
    assert ix.worker_stats(M)[("w", 0)]["gpu"] == 6


@pytest.mark.parametrize("hk", ["int", "bytes"])
def test_three_group_stream_matches_the_brute_force_model(ix, feed, hk) -> None:
    h = ids(hk)
    model = HybridModel(BS)

    def both(evs: list) -> None:
        feed(ix, "w", evs)
        model.apply("w", evs)

    def check(kv: int) -> None:
        for n in range(0, 7):
            d, c, k, _ = row(ix, TOK[:n * BS])
            assert (d, c) == model.usable("w", TOK[:n * BS]), n
            assert k == min(n, kv) == model.workers["w"].kv_blocks(TOK[:n * BS], BS)

    both([stored(h, range(6), 0, "full_attention"),
          stored(h, range(6), 1, "sliding_window", window=5),
          stored(h, [3], 2, "mamba"), stored(h, [5], 2, "mamba")])
    assert row(ix) == (6, 6, 6, (6, 0, 0, 0))
    check(6)
    both([BlockRemoved([h[5]], "GPU", group_idx=1)])  # the window block before L=6 gone
    assert row(ix)[:3] == (4, 4, 6)
    check(6)
    both([BlockRemoved([h[3]], "GPU", group_idx=2)])  # the state at block 3 gone
    assert row(ix)[:3] == (0, 0, 6)
    check(6)
    both([stored(h, [3], 2, "mamba", medium="CPU_PINNED")])  # host-backed state
    assert row(ix) == (0, 4, 6, (3, 1, 0, 0))  # block 3 is split to its state's tier
    check(6)
    both([BlockRemoved([h[0]], "GPU", group_idx=7)])  # a group never stored: ignored
    check(6)
    both([BlockRemoved([h[0]], "GPU", group_idx=1)])  # the SWA copy of block 0 only
    check(6)
    both([BlockRemoved([h[4]], "GPU", group_idx=0)])  # the KV itself
    assert row(ix)[:3] == (0, 4, 4)
    check(4)
    both([stored(h, [4], 0, "full_attention", medium="DISK"), stored(h, [5], 2, "mamba", medium="DISK"),
          stored(h, [5], 1, "sliding_window", window=5, medium="DISK")])
    check(6)
    assert row(ix) == (0, 6, 6, (4, 0, 2, 0))
    both([AllBlocksCleared()])
    assert row(ix)[:3] == (0, 0, 0)


def test_unknown_group_removes_are_counted() -> None:
    for native in (True, False):
        ix = KVIndex(native=native)
        ix.ensure_model(M, BS)
        h = ids("int")
        ix.apply_payload(M, "w", 0, encode_batch(KVEventBatch(0.0, [stored(h, range(2), 0, "full_attention")])))
        st = ix.apply_payload(M, "w", 0, encode_batch(KVEventBatch(0.0, [BlockRemoved(h[:2], "GPU", group_idx=3)])))
        assert st.drops == {"unknown_group": 2}
        assert row(ix, TOK[:8]) == (2, 2, None, (2, 0, 0, 0))  # still full-attention-only: no kv_blocks
        st = ix.apply(M, "w", 0, KVEventBatch(0.0, [stored(h, range(2), 1, "sliding_window", window=3)]))
        assert st.counts == {("group_stored", "GPU", "new"): 2}
        # group 1 changes kind: the worker's engine changed its layout, so its whole state goes (counted)
        st = ix.apply(M, "w", 0, KVEventBatch(0.0, [stored(h, range(2), 1, "mamba"), BlockRemoved([h[0]], "GPU", group_idx=1)]))
        assert st.counts == {("layout", "ALL", "reset"): 1, ("group_stored", "GPU", "new"): 2,
                             ("group_removed", "GPU", "removed"): 1}
        assert row(ix, TOK[:8])[:3] == (0, 0, 0)


def test_mamba_first_stream_picks_the_full_group_as_main() -> None:
    """vLLM may number a Mamba group before the attention group: the first full-attention group seen
    becomes the main tree, and group 0's removes are the Mamba group's."""
    h = ids("int")
    for kind in ("native", "pure", "reference"):
        ix = make(kind)
        ix.apply(M, "w", 0, KVEventBatch(0.0, [stored(h, [1], 0, "mamba"), stored(h, range(3), 1, "full_attention"),
                                               stored(h, [1], 0, "mamba")]))
        assert row(ix, TOK[:12])[:3] == (2, 2, 3), kind
        ix.apply(M, "w", 0, KVEventBatch(0.0, [BlockRemoved([h[1]], "GPU", group_idx=0)]))
        assert row(ix, TOK[:12])[:3] == (0, 0, 3), kind
        ix.apply(M, "w", 0, KVEventBatch(0.0, [BlockRemoved([h[0]], "GPU", group_idx=1)]))
        assert row(ix, TOK[:12])[:3] == (0, 0, 0), kind


def test_groups_survive_dump_and_load() -> None:
    h = ids("bytes")
    src = KVIndex()
    src.ensure_model(M, BS)
    src.apply(M, "w", 0, KVEventBatch(0.0, [stored(h, range(6), 0, "full_attention"),
                                            stored(h, range(6), 1, "sliding_window", window=9, medium="CPU"),
                                            stored(h, [4], 2, "mamba")]))
    src.register_worker(M, "idle")
    before = src.score(M, TOK)
    for native in (True, False):
        dst = KVIndex(native=native)
        dst.load_dump(M, BS, src.dump(M))
        assert dst.score(M, TOK) == before
        assert row(dst) == (0, 5, 6, (3, 2, 0, 0))
        # removes after the reload still find their group
        dst.apply(M, "w", 0, KVEventBatch(0.0, [BlockRemoved([h[4]], "GPU", group_idx=2)]))
        assert row(dst)[:3] == (0, 0, 6)
    # dump events fed to apply are skipped and counted, never applied
    k = KVIndex()
    k.ensure_model(M, BS)
    k.apply(M, "w", 0, KVEventBatch(0.0, [stored(h, range(6), 0, "full_attention")]))
    evs = [e for _, _, es in src.dump(M) for e in es]
    st = k.apply(M, "w", 0, KVEventBatch(0.0, evs))
    assert set(st.drops) == {"non_full_attention"} and not st.counts


def test_full_attention_only_models_keep_the_fast_path() -> None:
    """vLLM full-only streams (group_idx 0) stay on the accelerator and score without kv_blocks."""
    h = ids("int")
    ix = KVIndex(native=True)
    ix.ensure_model(M, BS)
    ix.apply_payload(M, "w", 0, encode_batch(KVEventBatch(0.0, [stored(h, range(6), 0, "full_attention")])))
    m = ix._models[M]
    assert m.groups is None and ix._accel is not None
    assert row(ix) == (6, 6, None, (6, 0, 0, 0))


# --- random group histories against the reference ------------------------------------------------

def _history(seed: int) -> tuple[list[tuple[str, list]], list[list[int]]]:
    """True-order vLLM-shaped histories: chains stored per group (full 0, sliding 1, mamba 2, and
    sometimes a second full group 3), removes per group, placeholders, clears, odd groups. One event
    per batch: an orphan is then dropped by KVIndex exactly when the reference drops it."""
    rng = random.Random(seed)
    window = rng.choice([None, 1, 3, 5, 9])
    roots = [[rng.randrange(3) for _ in range(BS * 5)] for _ in range(3)]
    out = []
    for _ in range(100):
        wid = rng.choice(["a", "b"])
        evs: list = []
        for _ in range(1):  # noqa: B007 - one event (or one request's stores) per batch
            r = rng.random()
            root = rng.randrange(3)
            toks = roots[root]
            hs = [root * 100 + i + 1 for i in range(5)]
            if rng.random() < 0.3:
                hs = [x.to_bytes(32, "big") for x in hs]
            a = rng.randrange(5)
            b = rng.randint(a + 1, 5)
            medium = rng.choice(["GPU", "GPU", "CPU_PINNED", "DISK", "EXTERNAL"])
            if r < 0.3:  # a request: the KV, the window and a state at its end, together
                a = 0 if rng.random() < 0.5 else a
                for g, kind in ((0, "full_attention"), (1, "sliding_window"), (2, "mamba")):
                    lo = b - 1 if g == 2 else a
                    evs.append(BlockStored(hs[lo:b], hs[lo - 1] if lo else None, toks[lo * BS:b * BS], BS, None,
                                           medium, group_idx=g, kv_cache_spec_kind=kind,
                                           kv_cache_spec_sliding_window=window if g == 1 else None))
            elif r < 0.55:
                g = rng.choice([0, 0, 1, 2, 3, 5])
                kind = {0: "full_attention", 1: "sliding_window", 2: "mamba", 3: "full_attention", 5: "cross_attention"}[g]
                if g == 2 and rng.random() < 0.7:
                    a = b - 1
                evs.append(BlockStored(hs[a:b], hs[a - 1] if a else None, toks[a * BS:b * BS], BS, None, medium,
                                       group_idx=g, kv_cache_spec_kind=kind,
                                       kv_cache_spec_sliding_window=window if g == 1 else None))
            elif r < 0.85:
                evs.append(BlockRemoved(hs[a:b], medium, group_idx=rng.choice([None, 0, 1, 2, 3, 4])))
            elif r < 0.95:
                evs.append(BlockStored(hs[a:b], None, [], 0, None, medium, group_idx=rng.choice([0, 1, 2]),
                                       kv_cache_spec_kind=rng.choice(["full_attention", "sliding_window", "mamba"]),
                                       kv_cache_spec_sliding_window=window))
            else:
                evs.append(AllBlocksCleared())
        out.append((wid, evs))
    return out, roots


@pytest.mark.parametrize("seed", range(16))
def test_random_group_histories_match_the_reference(ix, feed, seed: int) -> None:
    ref = ReferenceIndex()
    ref.ensure_model(M, BS)
    hist, roots = _history(seed)
    rng = random.Random(seed)
    for wid, evs in hist:
        feed(ix, wid, evs)
        ref.apply(M, wid, 0, KVEventBatch(0.0, evs))
        q = roots[rng.randrange(3)][: BS * rng.randint(0, 5)]
        assert ix.score(M, q) == ref.score(M, q)
    assert ix.worker_stats(M) == ref.worker_stats(M)
    if isinstance(ix, KVIndex):
        back = KVIndex(native=ix.native, orphan_grace_batches=0)
        back.load_dump(M, BS, ix.dump(M))
        for t in roots:
            assert back.score(M, t) == ref.score(M, t)


def test_the_worked_example_of_docs_hybrid(ix, feed) -> None:
    """docs/hybrid.md, "The indexer": window 9 tokens (2 blocks of 4), Mamba states at blocks 3 and 5."""
    h = ids("int")
    feed(ix, "w", [stored(h, range(6), 0, "full_attention"),
                   stored(h, range(6), 1, "sliding_window", window=9),
                   stored(h, [3], 2, "mamba"), stored(h, [5], 2, "mamba")])
    feed(ix, "w", [stored(h, [2, 3], 1, "sliding_window", window=9, medium="CPU_PINNED"),
                   BlockRemoved(h[:4], "GPU", group_idx=1), BlockRemoved([h[5]], "GPU", group_idx=1)])
    s = ix.score(M, TOK).workers[0]
    assert (s.device_blocks, s.cached_blocks, s.kv_blocks, s.tiers, s.score) == (
        0, 4, 6, {"gpu": 2, "host": 2, "disk": 0, "shared": 0}, 14.4)


def test_score_rows_carry_kv_blocks_only_for_hybrid_models() -> None:
    from schemas.api import TierBlocks, WorkerScoreOut, json_encoder

    base = dict(worker_id="w", dp_rank=0, device_blocks=1, cached_blocks=2, tiers=TierBlocks(1, 1), score=1.0,
                stale=False, last_seq=None, status="live")
    assert b"kv_blocks" not in json_encoder.encode(WorkerScoreOut(**base))
    assert b'"last_seq":null' in json_encoder.encode(WorkerScoreOut(**base))
    assert b'"kv_blocks":3' in json_encoder.encode(WorkerScoreOut(**base, kv_blocks=3))


def test_group_residency_follows_a_worker_whose_slot_moves(ix, feed) -> None:
    """Removing workers keeps slots dense: a worker in a freed 64-bit word moves to a lower slot
    (indexer/core/state.py). Its per-group residency must move with it, or its usable prefix breaks."""
    h = ids("int")
    wids = [f"w{i:02d}" for i in range(18)]  # 16 slots fill one word; w16, w17 open a second one
    for wid in wids:
        feed(ix, wid, [stored(h, range(6), 0, "full_attention"),
                       stored(h, range(6), 1, "sliding_window", window=5),
                       stored(h, [5], 2, "mamba")])
    want = row(ix, wid="w17")
    assert want[:3] == (6, 6, 6)
    for wid in wids[:2]:  # two slots free: w16 and w17 fit in the first word again
        ix.remove_worker(M, wid)
    assert row(ix, wid="w17") == want and row(ix, wid="w16") == want
    feed(ix, "w17", [BlockRemoved([h[5]], "GPU", group_idx=2)])  # its state at block 5 goes
    assert row(ix, wid="w17")[:2] == (0, 0) and row(ix, wid="w16") == want


@pytest.mark.parametrize("shape", ["no_state", "window_gone", "second_full_group", "other_worker_full_group",
                                   "kv_on_host_and_disk"])
def test_kv_blocks_is_the_full_attention_match_whatever_the_usable_prefix(ix, feed, shape) -> None:
    """kv_blocks is the worker's own full-attention (main tree) match over any tier, also when its
    usable prefix is 0: the probe of issue 22 (usable prefix 0, full-attention match 6 -> kv_blocks 6)."""
    h = ids("int")
    kv = [stored(h, range(6), 0, "full_attention")]
    if shape == "kv_on_host_and_disk":
        kv = [stored(h, range(3), 0, "full_attention", medium="CPU_PINNED"),
              stored(h, range(3, 6), 0, "full_attention", medium="DISK")]
    groups = {
        "no_state": [stored(h, [5], 1, "mamba"), BlockRemoved([h[5]], "GPU", group_idx=1)],
        "window_gone": [stored(h, range(6), 1, "sliding_window", window=9), BlockRemoved(h, "GPU", group_idx=1)],
        "second_full_group": [stored(h, [5], 1, "mamba"), BlockRemoved([h[5]], "GPU", group_idx=1),
                              stored(h, [0], 3, "full_attention")],
        "other_worker_full_group": [stored(h, [5], 1, "mamba"), BlockRemoved([h[5]], "GPU", group_idx=1)],
        "kv_on_host_and_disk": [stored(h, [5], 1, "mamba"), BlockRemoved([h[5]], "GPU", group_idx=1)],
    }[shape]
    feed(ix, "w", kv + groups)
    if shape == "other_worker_full_group":  # another worker's layout has a second full group: not w's
        feed(ix, "x", [stored(h, [0], 0, "full_attention"), stored(h, [0], 3, "full_attention")])
    assert row(ix)[:3] == (0, 0, 6)


def test_native_index_scores_hybrid_workers_in_c(monkeypatch) -> None:
    """With the accelerator, hybrid rows come from the C walk (hybrid_rows), not the pure core's."""
    import indexer.index as index_mod

    def boom(*a, **kw):
        raise AssertionError("pure usable-prefix scoring used on the native index")

    monkeypatch.setattr(index_mod, "score_groups", boom)
    ix = make("native")
    h = ids("int")
    ix.apply(M, "w", 0, KVEventBatch(0.0, [stored(h, range(6), 0, "full_attention"), stored(h, [3], 1, "mamba")]))
    ix.register_worker(M, "plain")
    assert row(ix)[:3] == (4, 4, 6)
