"""One conformance suite, run against every implementation of the index (docs/index-core.md):
KVIndex on the C accelerator, KVIndex on the pure-Python core, and the brute-force reference
(tests/support/reference.py). Each test drives the `indexer.protocol.Index` methods with observable
state (apply / apply_payload, register / clear / remove worker, workers, worker_stats, score) and
checks answers that are written down, so every backend is held to the same spec, not to each other.
The two KVIndex cores must also agree on ApplyStats and node keys (`test_cores_agree_on_stats_and_keys`)."""
from __future__ import annotations

import random
from typing import Any

import pytest

from indexer.core import native as native_core
from indexer.index import KVIndex
from indexer.protocol import Index, ScoringIndex
from indexer.sharded import ShardedIndex
from schemas.codec import encode_batch
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from support.reference import ReferenceIndex

BS = 2
M = "m"


@pytest.fixture(params=["native", "pure", "reference", "sharded", "sharded-pure"])
def ix(request) -> Any:
    if request.param == "reference":
        r = ReferenceIndex()
    elif request.param.startswith("sharded"):  # 3 shards: "a", "b", "c" in shards 1, 2, 0
        r = ShardedIndex(3, placement=lambda w: ord(w[0]) % 3, native=request.param == "sharded")
        assert isinstance(r, Index)
    else:
        r = KVIndex(native=request.param == "native")
        assert isinstance(r, Index)
    r.ensure_model(M, BS)
    return r


@pytest.fixture(params=["apply", "payload"])
def feed(request):
    """Each scenario runs both through typed batches and through raw payloads (the C walk's input)."""
    def go(ix: Any, wid: str, events: list, rank: int = 0) -> None:
        b = KVEventBatch(0.0, events)
        if request.param == "apply":
            ix.apply(M, wid, rank, b)
        else:
            ix.apply_payload(M, wid, rank, encode_batch(b))
    return go


def S(hashes, parent, toks, bs=BS, **kw) -> BlockStored:
    return BlockStored(hashes, parent, toks, bs, **kw)


def rows(ix: Any, toks: list[int], **kw) -> list[tuple]:
    return [(w.worker_id, w.dp_rank, w.device_blocks, w.cached_blocks, w.tiers["gpu"], w.tiers["host"],
             w.tiers["disk"], w.tiers["shared"]) for w in ix.score(M, toks, **kw).workers]


def test_chain_store_score_and_stats(ix, feed) -> None:
    feed(ix, "a", [S([1, 2], None, [1, 2, 3, 4]), S([3], 2, [5, 6])])
    feed(ix, "b", [S([9], None, [1, 2], medium="cpu")])
    assert rows(ix, [1, 2, 3, 4, 5, 6, 7]) == [("a", 0, 3, 3, 3, 0, 0, 0), ("b", 0, 0, 1, 0, 1, 0, 0)]
    assert ix.worker_stats(M) == {("a", 0): {"gpu": 3, "host": 0, "disk": 0, "shared": 0},
                                  ("b", 0): {"gpu": 0, "host": 1, "disk": 0, "shared": 0}}
    assert sorted(ix.workers(M)) == [("a", 0), ("b", 0)]


def test_tiers_placeholders_removes_and_clear(ix, feed) -> None:
    feed(ix, "a", [S([1, 2], None, [1, 2, 3, 4])])
    feed(ix, "a", [S([1, 2], None, [], bs=0, medium="CPU_PINNED"), BlockRemoved([2], medium="GPU")])
    assert rows(ix, [1, 2, 3, 4]) == [("a", 0, 1, 2, 1, 1, 0, 0)]
    feed(ix, "a", [S([7], None, [], bs=0, medium="DISK")])  # placeholder naming an unknown hash: skipped
    feed(ix, "a", [BlockRemoved([1, 2], medium="host")])
    assert rows(ix, [1, 2, 3, 4]) == [("a", 0, 1, 1, 1, 0, 0, 0)]
    feed(ix, "a", [AllBlocksCleared()])
    assert rows(ix, [1, 2, 3, 4]) == [("a", 0, 0, 0, 0, 0, 0, 0)]


def test_shared_pool_is_usable_by_every_worker(ix, feed) -> None:
    feed(ix, "a", [S([1], None, [1, 2], medium="EXTERNAL")])
    ix.register_worker(M, "b")
    assert rows(ix, [1, 2]) == [("a", 0, 0, 1, 0, 0, 0, 1), ("b", 0, 0, 1, 0, 0, 0, 1)]
    feed(ix, "a", [BlockRemoved([1], medium="shared")])
    assert rows(ix, [1, 2]) == [("a", 0, 0, 0, 0, 0, 0, 0), ("b", 0, 0, 0, 0, 0, 0, 0)]


def test_skipped_events_change_nothing(ix, feed) -> None:
    feed(ix, "a", [
        S([1], None, [1, 2], kv_cache_spec_kind="sliding_window"),
        S([2], None, [1, 2], bs=4),  # block size of another model
        S([3], None, [1]),  # partial block only
        S([4], None, [1, 2], medium="tape"),  # unknown medium
        S([], 99, [1, 2]),  # no blocks, unknown parent: nothing to store (both cores skip it)
        S([], None, [1, 2]),
    ])
    assert ix.worker_stats(M) == {("a", 0): {"gpu": 0, "host": 0, "disk": 0, "shared": 0}}
    assert rows(ix, [1, 2]) == [("a", 0, 0, 0, 0, 0, 0, 0)]


def test_one_bad_event_keeps_its_neighbours(ix) -> None:
    """A payload the decoder refuses for one event (wrong type, unknown tag, empty bytes hash) applies
    its other events on every backend; a payload whose shell is bad changes nothing."""
    import msgspec

    good = [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2], "block_size": BS},
            {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": 1, "token_ids": [3, 4], "block_size": BS}]
    for i, bad in enumerate(({"type": "BlockRemoved", "block_hashes": ["x"]}, {"type": "BlockEvicted"},
                             {"type": "BlockRemoved", "block_hashes": [b""]})):
        ix.apply_payload(M, f"w{i}", 0, msgspec.msgpack.encode([0.0, [good[0], bad, good[1]]]))
    ix.apply_payload(M, "z", 0, msgspec.msgpack.encode(["late", good]))
    assert rows(ix, [1, 2, 3, 4]) == [(f"w{i}", 0, 2, 2, 2, 0, 0, 0) for i in range(3)]


def test_namespaces_and_extra_keys(ix, feed) -> None:
    feed(ix, "a", [S([1], None, [1, 2], lora_name="l"), S([2], None, [1, 2], extra_keys=[["img", 1]])])
    assert rows(ix, [1, 2]) == [("a", 0, 0, 0, 0, 0, 0, 0)]
    assert rows(ix, [1, 2], lora_name="l") == [("a", 0, 1, 1, 1, 0, 0, 0)]
    assert rows(ix, [1, 2], extra_keys=[["img", 1]]) == [("a", 0, 1, 1, 1, 0, 0, 0)]


def test_worker_lifecycle(ix, feed) -> None:
    feed(ix, "a", [S([1], None, [1, 2])], rank=0)
    feed(ix, "a", [S([1], None, [1, 2])], rank=1)
    ix.clear_worker(M, "a", 1)
    assert rows(ix, [1, 2]) == [("a", 0, 1, 1, 1, 0, 0, 0), ("a", 1, 0, 0, 0, 0, 0, 0)]
    ix.remove_worker(M, "a")
    assert ix.workers(M) == [] and rows(ix, [1, 2]) == []


def _history(seed: int) -> list[tuple[str, int, list]]:
    """A random true-order history: stores chain from held blocks (or are orphans forever), removes,
    placeholders, clears, odd events."""
    rng = random.Random(seed)
    held: dict[tuple[str, int], list[int]] = {}
    out = []
    nxt = 1
    for _ in range(60):
        key = rng.choice([("a", 0), ("a", 1), ("b", 0)])
        hs = held.setdefault(key, [])
        evs: list = []
        for _ in range(rng.randint(1, 4)):
            r = rng.random()
            if r < 0.5:
                n = rng.randint(0, 3)
                new = list(range(nxt, nxt + n))
                nxt += n + 1
                parent = rng.choice([None, *hs[-3:]]) if rng.random() < 0.9 else 10**9 + nxt
                toks = [rng.randrange(4) for _ in range(BS * n + rng.randint(0, 1))]
                evs.append(S(new, parent, toks, medium=rng.choice([None, "CPU", "DISK", "EXTERNAL"]),
                             kv_cache_spec_kind=rng.choice([None, None, "full", "sliding"])))
                if parent is None or parent in hs:
                    hs.extend(new)
            elif r < 0.7 and hs:
                evs.append(BlockRemoved(rng.sample(hs, min(len(hs), 2)), medium=rng.choice([None, "CPU"])))
            elif r < 0.85 and hs:
                evs.append(S(rng.sample(hs, 1), None, [], bs=0, medium="DISK"))
            elif r < 0.9:
                evs.append(AllBlocksCleared())
                hs.clear()
        out.append((key[0], key[1], evs))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_random_histories_match_the_reference(ix, feed, seed: int) -> None:
    ref = ReferenceIndex()
    ref.ensure_model(M, BS)
    rng = random.Random(seed)
    for wid, rank, evs in _history(seed):
        feed(ix, wid, evs, rank)
        ref.apply(M, wid, rank, KVEventBatch(0.0, evs))
    for _ in range(4):  # orphans that never find a parent expire
        for wid, rank in list(ref.workers(M)):
            feed(ix, wid, [], rank)
    assert ix.worker_stats(M) == ref.worker_stats(M)
    for _ in range(20):
        q = [rng.randrange(4) for _ in range(BS * rng.randint(1, 6))]
        assert ix.score(M, q) == ref.score(M, q)


@pytest.mark.skipif(not native_core.available(), reason="needs both cores")
@pytest.mark.parametrize("seed", range(12))
def test_cores_agree_on_stats_and_keys(seed: int) -> None:
    """Beyond observable state, the two KVIndex cores count every event the same and hold the same keys."""
    cores = [KVIndex(native=True), KVIndex(native=False)]
    for c in cores:
        c.ensure_model(M, BS)
    for wid, rank, evs in _history(seed):
        payload = encode_batch(KVEventBatch(0.0, evs, rank))
        got = [c.apply_payload(M, wid, 0, payload, rank_from_batch=True) for c in cores]
        assert got[0] == got[1]
        got = [c.apply(M, wid, rank, KVEventBatch(0.0, evs)) for c in cores]
        assert got[0] == got[1]
    ms = [c._models[M] for c in cores]
    assert sorted(ms[0].nodes.items()) == sorted(ms[1].nodes.items())
    assert [sorted(w.ext.items()) for w in ms[0].by_id.values()] == [sorted(w.ext.items()) for w in ms[1].by_id.values()]


@pytest.mark.parametrize("kind", ["native", "pure", "sharded"])
def test_service_indexes_declare_what_the_service_calls(kind: str) -> None:
    """KVIndex and ShardedIndex are `ScoringIndex`es: packed rows, shard count and placement, and
    a public model view that scores like the index itself."""
    ix: Any = (ShardedIndex(3, placement=lambda w: ord(w[0]) % 3) if kind == "sharded"
               else KVIndex(native=kind == "native"))
    assert isinstance(ix, ScoringIndex)
    ix.ensure_model(M, BS)
    ix.apply(M, "a", 0, KVEventBatch(0.0, [S([1, 2], None, [1, 2, 3, 4])]))
    ix.apply(M, "b", 0, KVEventBatch(0.0, [S([5], None, [1, 2], medium="CPU_PINNED")]))
    if kind == "sharded":
        assert ix.shard_count == 3 and [ix.shard_of(w) for w in "abc"] == [1, 2, 0]
        with pytest.raises(KeyError):
            ix.shards[0].model_state("nope")
    else:
        assert ix.shard_count == 1 and ix.shard_of("a") == 0
        view = ix.model_state(M)
        assert ix.score_model(view, [1, 2, 3, 4], None, None, None, None) == ix.score(M, [1, 2, 3, 4])
    table = ix.score_table(M, [1, 2, 3, 4])
    assert (table is None) == (not ix.native)
    if table is not None:
        assert table.query_blocks == 2
