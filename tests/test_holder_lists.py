"""Holder lists (indexer/_native/holders.c, docs/scaling.md "The index at scale"): a main tree's map
(`U64Map.holders()`) keeps dense words up to 128 worker slots, then stores each node's residency as
a short sorted list of (slot, nibble) inline, a list in a block, or dense words in a block where a node
is widely held. Every form reads and writes the same ints as a dict, through every transition (inline
-> list -> dense -> list -> inline, dense table -> lists -> dense table by `narrow`: the map's own
encode / decode); and an index past 1k workers, whose C apply writes a bit at a time (the forms'
per-slot writes and reads), answers, counts tiers, dumps and restores exactly as the pure core and the
brute-force reference do, whichever form its nodes are in, through worker churn and snapshots taken in
one form and restored into another."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from indexer.core import native as native_core
from indexer.index import KVIndex
from indexer.snapshot import SNAPSHOT_VERSION, ModelSnapshot, Snapshot, decode_snapshot, encode_snapshot
from schemas.codec import encode_batch
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

pytestmark = pytest.mark.skipif(not native_core.available(), reason="accelerator not built")

MODEL, BS = "m", 4
MEDIA = ["GPU", "CPU", "DISK", "EXTERNAL"]


def _kvn():
    from indexer._native import _kvnative

    return _kvnative


# slots: a node's holders bunched low (dense table), spread wide (lists), or many in a narrow band
# (a widely held node: dense words inside its block)
SLOTS = st.one_of(st.integers(0, 127), st.integers(0, 5000), st.integers(1000, 1100))
OPS = st.lists(
    st.tuples(st.sampled_from(["set", "clear", "del", "band", "unband", "narrow", "int"]), st.integers(1, 6), SLOTS,
              st.integers(1, 15)),
    min_size=1, max_size=80)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_holder_map_reads_and_writes_what_a_dict_does(ops: list) -> None:
    m, ref = _kvn().U64Map.holders(), {}
    forms = set()
    for op, k, slot, nib in ops:
        cur = ref.get(k, 0)
        if op == "set":  # one slot's nibble
            new = (cur & ~(0xF << 4 * slot)) | nib << 4 * slot
        elif op == "clear":  # a holder goes (the lowest, else the given slot)
            held = [s for s in range(cur.bit_length() // 4 + 1) if cur >> 4 * s & 0xF]
            new = cur & ~(0xF << 4 * (held[0] if held else slot))
        elif op == "band":  # 100 holders in slot .. slot + 99: widely held
            new = cur
            for s in range(slot, slot + 100):
                new |= nib << 4 * s
        elif op == "unband":  # all but the band's first 3 holders go again
            new = cur & ((1 << 4 * (slot + 3)) - 1)
        elif op == "int":  # a whole value at once (the pure core's writes)
            new = random.Random(slot).getrandbits(4 * (slot + 1))
        elif op == "del":
            if k in ref:
                del ref[k], m[k]
            continue
        else:
            m.narrow()
            forms.add(m.form)
            assert dict(m.items()) == ref
            continue
        ref[k] = new
        m[k] = new
        forms.add(m.form)
        assert m.get(k) == new and len(m) == len(ref)
    assert dict(m.items()) == ref and sorted(m.keys()) == sorted(ref)
    if all(v < 1 << (4 * 128) for v in ref.values()):
        m.narrow()  # what is held fits 128 slots again: dense words
        assert m.form == "dense" and dict(m.items()) == ref
    m.clear()
    assert len(m) == 0 and m.form == "dense"


def test_each_form_of_a_node_costs_what_its_holders_cost() -> None:
    m = _kvn().U64Map.holders()
    m[1] = 1 << (4 * 9999)  # one holder at slot 9,999: two words inline, not 625
    assert m.form == "lists" and m.width == 2
    small = m.nbytes
    for s in range(1, 4):  # four holders: still inline
        m[1] |= 1 << (4 * s * 2000)
    assert m.nbytes == small
    m[1] |= 1 << 4 * 5  # a fifth: a list block of 8 entries
    assert small < m.nbytes <= small + 64
    m[2] = sum(1 << 4 * s for s in range(10_000))  # everyone: dense words in a block (5 KB, not 40)
    assert m.nbytes - small < 5_100 + 200
    assert m[2] == sum(1 << 4 * s for s in range(10_000)) and m[1].bit_count() == 5


def _payload(evs: list) -> bytes:
    return encode_batch(KVEventBatch(0.0, evs))


def _history(seed: int, n_workers: int) -> tuple[list[tuple[str, int, bytes]], list[list[int]]]:
    """Chained documents stored by random workers (two dp ranks some of them) on random tiers, a few
    documents held by most of the fleet (widely held nodes), removes and clears."""
    rng = random.Random(seed)
    docs: list[list[int]] = []
    for _ in range(10):
        base = list(rng.choice(docs)[: BS * rng.randint(1, 2)]) if docs and rng.random() < 0.5 else []
        docs.append(base + [rng.randrange(1, 50_000) for _ in range(BS * rng.randint(1, 4))])
    out = []
    for i in range(n_workers * 2):
        wid, rank = f"w{rng.randrange(n_workers):05d}", rng.choice([0, 0, 0, 1])
        d = docs[0] if rng.random() < 0.4 else rng.choice(docs)  # docs[0]: held by most workers
        n = rng.randint(1, len(d) // BS)
        toks = d[: n * BS]
        medium = rng.choice(MEDIA) if rng.random() < 0.3 else "GPU"
        if medium == "EXTERNAL" and rng.random() < 0.8:
            medium = "GPU"
        hashes = [hash((tuple(toks[: (j + 1) * BS]), medium)) & (2**63 - 1) or 1 for j in range(n)]
        evs: list = [BlockStored(hashes, None, toks, BS, medium=medium)]
        r = rng.random()
        if r < 0.15:
            evs.append(BlockRemoved(hashes[rng.randrange(n):], medium=medium))
        elif r < 0.17:
            evs.append(AllBlocksCleared())
        out.append((wid, rank, _payload(evs)))
    queries = [d + [rng.randrange(1, 50_000) for _ in range(BS)] for d in docs]
    return out, queries


def _state(ix: KVIndex) -> tuple:
    m = ix._models[MODEL]
    return (sorted(m.nodes.items()), {k: (w.slot, sorted(w.ext.items())) for k, w in m.by_id.items()})


def _answers(ix: KVIndex, queries: list[list[int]]) -> tuple:
    return ix.worker_stats(MODEL), [ix.score(MODEL, q) for q in queries]


def _codec(dump: list) -> list:
    snap = Snapshot(SNAPSHOT_VERSION, 1, 0.0, [], [ModelSnapshot(MODEL, BS, dump)])
    return decode_snapshot(encode_snapshot(snap)).models[0].workers


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_workers=st.sampled_from([100, 300, 1500]))
def test_a_wide_index_matches_the_pure_core_through_churn_and_snapshots(seed: int, n_workers: int) -> None:
    from support.reference import ReferenceIndex

    pays, queries = _history(seed, n_workers)
    fast, pure, ref = KVIndex(native=True), KVIndex(native=False), ReferenceIndex()
    for ix in (fast, pure, ref):
        ix.ensure_model(MODEL, BS)
    half = len(pays) // 2
    for wid, rank, p in pays[:half]:
        for ix in (fast, pure, ref):
            ix.apply_payload(MODEL, wid, rank, p)
    snap_early = _codec(fast.dump(MODEL))  # a snapshot taken in this form ...
    for wid, rank, p in pays[half:]:
        for ix in (fast, pure, ref):
            ix.apply_payload(MODEL, wid, rank, p)
    nodes = fast._models[MODEL].nodes
    assert nodes.form == ("lists" if len(fast._models[MODEL].workers) > 128 else "dense")

    def same() -> None:  # the pure core's state, and the brute-force reference's answers
        assert _state(fast) == _state(pure) and _answers(fast, queries) == _answers(pure, queries) == \
            _answers(ref, queries)

    same()
    # churn: workers go (slots compacted, bits moved between slots), then the table may narrow
    rng = random.Random(seed)
    gone = rng.sample(sorted(fast._models[MODEL].by_id), k=len(fast._models[MODEL].by_id) * 9 // 10)
    for wid, rank in gone[: len(gone) // 2]:
        for ix in (fast, pure, ref):
            ix.remove_worker(MODEL, wid, rank)
    same()
    snap_mid = _codec(fast.dump(MODEL))
    for wid, rank in gone[len(gone) // 2:]:
        for ix in (fast, pure, ref):
            ix.remove_worker(MODEL, wid, rank)
    same()
    if len(fast._models[MODEL].workers) <= 128:
        assert nodes.form == "dense"  # narrowed back
    # ... restored into fresh indexes, native and pure, in whatever form its slots need
    for snap in (snap_early, snap_mid, _codec(fast.dump(MODEL))):
        a, b = KVIndex(native=True), KVIndex(native=False)
        assert a.load_dump(MODEL, BS, snap) == b.load_dump(MODEL, BS, snap)
        assert _state(a) == _state(b) and _answers(a, queries) == _answers(b, queries)
        top = max((w.slot for w in a._models[MODEL].by_id.values() if w.ext), default=0)
        assert a._models[MODEL].nodes.form == ("lists" if top >= 128 else "dense")


@pytest.mark.parametrize("seed", range(4))
def test_hybrid_workers_past_128_slots_match_the_reference(seed: int) -> None:
    """A hybrid model whose main tree is in holder lists: its usable-prefix rows are the pure core's
    (`hybrid_rows` leaves such a tree to it) and the brute-force reference's, group maps staying dense."""
    from support.reference import ReferenceIndex
    from test_hybrid_index_streams import BS as HBS, M as HM, _history

    fast, pure, ref = KVIndex(native=True, orphan_grace_batches=0), KVIndex(native=False, orphan_grace_batches=0), \
        ReferenceIndex()
    filler = KVEventBatch(0.0, [BlockStored([9_000_001], None, [7] * HBS, HBS, medium="GPU")])
    for ix in (fast, pure, ref):
        ix.ensure_model(HM, HBS)
        for i in range(200):  # 200 plain workers first: the hybrid ones sit at slots 200 and 201
            ix.apply(HM, f"f{i:03d}", 0, filler)
    hist, roots = _history(seed)
    rng = random.Random(seed)
    for wid, evs in hist:
        for ix in (fast, pure, ref):
            ix.apply(HM, wid, 0, KVEventBatch(0.0, evs))
        q = roots[rng.randrange(3)][: HBS * rng.randint(0, 5)]
        assert fast.score(HM, q) == pure.score(HM, q) == ref.score(HM, q)
    assert fast._models[HM].nodes.form == "lists"
    assert fast.worker_stats(HM) == ref.worker_stats(HM)


@pytest.mark.slow  # 66k workers: ~5 s of CPU
def test_a_model_past_65536_worker_slots() -> None:
    """Dense words stop at 65,536 slots (MAX_SLOT); holder lists go on: the C apply leaves those
    workers' batches to the pure core, whose writes, the walk and restore take any slot below 2^24.
    Worker w holds document w % D (one block), so each document's holders are known exactly."""
    n, bs = 66_000, 4
    docs = n // 4
    pays = [_payload([BlockStored([d + 1], None, [d + 1] * bs, bs, medium="GPU")]) for d in range(docs)]
    fast = KVIndex(native=True)
    fast.ensure_model(MODEL, bs)
    for w in range(n):
        fast.apply_payload(MODEL, f"w{w:05d}", 0, pays[w % docs])
    assert fast._models[MODEL].nodes.form == "lists"
    back = KVIndex(native=True)
    assert back.load_dump(MODEL, bs, fast.dump(MODEL)) == n
    for d in {(n - 1) % docs, 65_536 % docs, 3}:
        want = sorted(f"w{w:05d}" for w in range(d, n, docs))
        for ix in (fast, back):
            got = [s for s in ix.score(MODEL, [d + 1] * bs).workers if s.cached_blocks]
            assert sorted(s.worker_id for s in got) == want and {s.cached_blocks for s in got} == {1}
