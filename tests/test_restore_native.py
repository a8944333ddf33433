"""Differential tests of snapshot restore: `load_dump` on the accelerator (`U64Map.load`: the main
tree's stores in one C call, the table laid out once at its final width; docs/scaling.md) restores
exactly what the pure core's per-entry loop (`dump.put_entries`, the reference) restores — node keys
and residency, each worker's slot and engine-hash map, group state, tier counts, scores — for dumps of
many workers (residency words several 64-bit words wide), malformed entries included, in one index and
worker-sharded, straight and through the snapshot codec. The per-entry loop run over the accelerator's
maps (what restore did before) ends with the same table width and capacity."""
from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from indexer.core import native as native_core
from indexer.core.dump import DUMP_KIND, load_model_dump
from indexer.core.groupdump import DUMP_GROUP, load_groups
from indexer.index import KVIndex
from indexer.sharded import ShardedIndex
from indexer.snapshot import SNAPSHOT_VERSION, ModelSnapshot, Snapshot, decode_snapshot, encode_snapshot
from schemas.events import BlockRemoved, BlockStored

pytestmark = pytest.mark.skipif(not native_core.available(), reason="accelerator not built")

MODEL, BS = "m", 16
MEDIA = ["GPU", "CPU_PINNED", "DISK", "EXTERNAL"]
# Content keys no C map may misread: 0 (the side dict), 2^63 and 2^64 - 1 (sign and width edges).
EDGE_KEYS = [0, 1, 2**63, 2**64 - 1]
NOT_KEYS: list[Any] = [-1, 2**64, True, 1.0, "7", None]  # skipped by both (not a u64 int)


def random_dump(seed: int, n_workers: int, n_docs: int, odd: bool) -> tuple[list, list[list[int]]]:
    """(dump, documents): each worker holds prefixes of a few documents (chains of content keys) on
    random tiers; with `odd`, malformed entries and events that both loads must skip alike."""
    rng = random.Random(seed)
    docs = [[rng.choice(EDGE_KEYS) if rng.random() < 0.05 else rng.getrandbits(64) for _ in range(rng.randint(1, 8))]
            for _ in range(n_docs)]
    dump: list = []
    for w in range(n_workers):
        events: list = []
        for _ in range(rng.randint(0, 3)):
            doc = rng.choice(docs)
            keys: list[Any] = doc[: rng.randint(1, len(doc))]
            hashes: list[Any] = [rng.choice([rng.getrandbits(63), rng.getrandbits(64).to_bytes(8, "little"), 0, -5])
                                 for _ in keys]
            kind, medium = DUMP_KIND, rng.choice(MEDIA)
            if odd:
                r = rng.random()
                if r < 0.15:
                    keys = [rng.choice(NOT_KEYS) if rng.random() < 0.3 else k for k in keys]
                elif r < 0.2:
                    keys = keys + [1]  # lengths differ: the event is skipped
                elif r < 0.25:
                    medium = "HBM"
                elif r < 0.3:
                    kind = "full_attention"
                elif r < 0.35:
                    events.append(BlockRemoved(hashes))
                elif r < 0.4:
                    hashes = tuple(hashes)  # type: ignore[assignment]  # not a list: the Python loop takes it
            events.append(BlockStored(hashes, None, [], 0, medium=medium, extra_keys=keys, kv_cache_spec_kind=kind))
        if odd and rng.random() < 0.3:  # group state (docs/hybrid.md): heads, then stores per group
            gi = rng.randint(1, 2)
            letter = rng.choice("FSM")
            events.append(BlockStored([], None, [], 0, medium="GPU", group_idx=gi, kv_cache_spec_kind=DUMP_GROUP + letter,
                                      kv_cache_spec_sliding_window=4 if letter == "S" else None))
            gkeys = rng.choice(docs)[:3]
            events.append(BlockStored([rng.getrandbits(63) for _ in gkeys], None, [], 0, medium=rng.choice(MEDIA),
                                      extra_keys=list(gkeys), group_idx=gi, kv_cache_spec_kind=DUMP_GROUP + letter))
        dump.append((f"w{w:03d}", rng.choice([0, 0, 0, 1]), events))
    if odd and dump and rng.random() < 0.3:
        dump.append(dump[rng.randrange(len(dump))])  # a worker twice: its stores load twice, in order
    return dump, docs


def state(ix: KVIndex) -> tuple:
    """Everything a restore sets: node keys and residency, each worker's slot and engine-hash map,
    its group layout and group residency."""
    m = ix._models[MODEL]
    workers = {
        k: (w.slot, sorted(w.ext.items(), key=repr), None if w.layout is None else (w.layout.primary, {
            gi: (g.kind, g.window, sorted(g.ext.get(w.slot, {}).items(), key=repr),
                 sorted(((key, g.nodes.get(key, 0) >> w.shift & 15) for key in g.ext.get(w.slot, {}).values()), key=repr))
            for gi, g in w.layout.groups.items()}))
        for k, w in m.by_id.items()
    }
    return sorted(m.nodes.items(), key=repr), workers


def answers(ix: KVIndex | ShardedIndex, docs: list[list[int]]) -> tuple:
    return ix.worker_stats(MODEL), [ix.score_keys(MODEL, d) for d in docs]


def through_codec(dump: list) -> list:
    """The dump as a restarted service reads it (snapshot bytes decoded: exact lists of ints and bytes)."""
    snap = Snapshot(SNAPSHOT_VERSION, 1, 0.0, [], [ModelSnapshot(MODEL, BS, dump)])
    return decode_snapshot(encode_snapshot(snap)).models[0].workers


def codec_safe(dump: list) -> list:
    """`dump` without what msgpack cannot carry: tuple hashes (their events go), keys past 2^64 (-1 for
    them, also not a key); the float / None / str keys of NOT_KEYS stay (`extra_keys` is Any)."""
    out = []
    for w, r, evs in dump:
        kept = []
        for ev in evs:
            if isinstance(ev, BlockStored) and type(ev.block_hashes) is tuple:
                continue
            if isinstance(ev, BlockStored) and ev.extra_keys:
                ev.extra_keys = [-1 if type(k) is int and k >= 2**64 else k for k in ev.extra_keys]
            kept.append(ev)
        out.append((w, r, kept))
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_workers=st.sampled_from([1, 3, 17, 40, 90, 150]),
       n_docs=st.integers(1, 12), odd=st.booleans(), codec=st.booleans())
def test_native_restore_equals_pure(seed: int, n_workers: int, n_docs: int, odd: bool, codec: bool) -> None:
    dump, docs = random_dump(seed, n_workers, n_docs, odd)
    if codec:
        dump = through_codec(codec_safe(dump))
    fast, pure = KVIndex(native=True), KVIndex(native=False)
    assert fast.native and not pure.native
    n = fast.load_dump(MODEL, BS, dump)
    assert n == pure.load_dump(MODEL, BS, dump)
    assert state(fast) == state(pure)
    assert answers(fast, docs) == answers(pure, docs)
    # The per-entry loop over the accelerator's maps (restore before U64Map.load): same state, and the
    # table ends as wide and as large (the C load widens once, to the width the loaded bits need).
    loop = KVIndex(native=True)
    loop.ensure_model(MODEL, BS)
    m = loop._models[MODEL]
    assert load_model_dump(m, dump) + load_groups(m, dump) == n
    assert state(loop) == state(fast)
    a, b = fast._models[MODEL].nodes, m.nodes
    assert (a.form, a.width) == (b.form, b.width)
    if a.form == "dense":  # (holder-list blocks keep the room their growth left: the two differ there)
        assert a.nbytes == b.nbytes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_workers=st.sampled_from([5, 40, 120]), shards=st.sampled_from([2, 3]),
       odd=st.booleans())
def test_sharded_native_restore_equals_pure(seed: int, n_workers: int, shards: int, odd: bool) -> None:
    dump, docs = random_dump(seed, n_workers, 8, odd)
    fast, pure = ShardedIndex(shards, native=True), ShardedIndex(shards, native=False)
    assert fast.load_dump(MODEL, BS, dump) == pure.load_dump(MODEL, BS, dump)
    for a, b in zip(fast.shards, pure.shards):
        assert state(a) == state(b)
    assert answers(fast, docs) == answers(pure, docs)
    one = KVIndex(native=False)  # and a sharded restore answers as one index restored from the same dump
    one.load_dump(MODEL, BS, dump)
    assert answers(fast, docs)[0] == answers(one, docs)[0]


def test_load_takes_only_exact_stores() -> None:
    """`U64Map.load` touches nothing unless every store is one it takes (then the Python loop runs)."""
    from indexer._native._kvnative import U64Map

    nodes, ext = U64Map(), U64Map()
    assert nodes.load([(ext, [1, 2], [10, 20], 4)]) == 2
    before = sorted(nodes.items()), sorted(ext.items())
    for bad in ([(ext, (1,), [5], 0)], [(ext, [1], [5, 6], 0)], [(ext, ["h"], [5], 0)], [(ext, [1], [5], -1)],
                [(ext, [1], [5], 2**40)], [(dict(), [1], [5], 0)], [(ext, [1], [5])], [(ext, [3], [7], 0), [1]]):
        assert nodes.load(bad) is None
    assert (sorted(nodes.items()), sorted(ext.items())) == before
    with pytest.raises(TypeError):
        nodes.load((ext, [1], [5], 0))
    # bits land at their word (a slot past the first 16), key 0 in the side dict, non-keys skipped
    assert nodes.load([(ext, [7, 8, 9, b"h"], [2**64 - 1, 0, -1, True], 4 * 40 + 3)]) == 2
    assert nodes[2**64 - 1] == 1 << 163 and nodes[0] == 1 << 163 and nodes.width == 3
    assert ext[7] == 2**64 - 1 and ext[8] == 0 and 9 not in ext and b"h" not in ext
