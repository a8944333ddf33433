"""Unit tests of the index core: event rules, bad input, namespaces, lifecycle, wire samples."""
from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest

from indexer import hashing as H
from indexer.core import native as native_core
from indexer.index import BlockSizeConflict, KVIndex, TierWeights
from schemas.codec import decode_batch
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BS = 4


def toks(n_blocks: int, base: int = 0) -> list[int]:
    return list(range(base, base + n_blocks * BS))


def batch(*events) -> KVEventBatch:
    return KVEventBatch(0.0, list(events))


@pytest.fixture(autouse=True, params=["native", "pure"])
def impl(request, monkeypatch) -> str:
    """Every test here runs on both cores: the C accelerator and the pure-Python reference."""
    if request.param == "native" and not native_core.available():
        pytest.skip("native accelerator not built")
    monkeypatch.setenv(native_core.ENV_PURE, "1" if request.param == "pure" else "0")
    return request.param


@pytest.fixture()
def ix(impl: str) -> KVIndex:
    i = KVIndex(orphan_grace_batches=2)
    i.ensure_model("m", BS)
    return i


def one(ix: KVIndex, tokens, **kw):
    res = ix.score("m", tokens, **kw)
    return {(w.worker_id, w.dp_rank): w for w in res.workers}


def test_hashing_vectorised_matches_scalar() -> None:
    rng = np.random.default_rng(1)
    t = rng.integers(0, 2**31, size=16 * 33 + 5).tolist()
    seed = H.namespace_seed(16, "lora", "salt")
    ex = [0] * 33
    ex[4] = H.extra_digest(["mm", 3])
    assert H.query_keys(t, 16, seed) == H.chain_keys_py(t, 16, seed)
    assert H.query_keys(np.asarray(t), 16, seed, ex) == H.chain_keys_py(t, 16, seed, ex)
    assert H.query_keys(t, 16, seed) != H.query_keys(t, 16, H.namespace_seed(16, None, None))


def test_store_score_tiers_and_weights(ix: KVIndex) -> None:
    ix.apply("m", "a", 0, batch(BlockStored([1, 2, 3], None, toks(3), BS, medium="GPU")))
    ix.apply("m", "a", 0, batch(BlockStored([2], None, [], 0, medium="CPU_PINNED"),
                                BlockRemoved([2, 3], medium="GPU")))
    s = one(ix, toks(3) + [99])
    a = s[("a", 0)]
    assert (a.device_blocks, a.cached_blocks) == (1, 2)  # block 3 is gone: no tier left
    assert a.tiers == {"gpu": 1, "host": 1, "disk": 0, "shared": 0}
    assert a.score == BS * (1.0 + 0.8)
    ix2 = KVIndex(weights=TierWeights(gpu=2.0, host=0.5))
    ix2.ensure_model("m", BS)
    ix2.apply("m", "a", 0, batch(BlockStored([1], None, toks(1), BS, medium="CPU")))
    assert ix2.score("m", toks(1)).workers[0].score == BS * 0.5


def test_shared_pool_serves_every_worker(ix: KVIndex) -> None:
    ix.register_worker("m", "idle", 0)
    ix.apply("m", "a", 0, batch(BlockStored([1, 2], None, toks(2), BS, medium="GPU"),
                                BlockStored([1, 2], None, toks(2), BS, medium="EXTERNAL")))
    s = one(ix, toks(2))
    assert s[("idle", 0)].cached_blocks == 2 and s[("idle", 0)].tiers["shared"] == 2
    assert s[("idle", 0)].device_blocks == 0
    assert s[("a", 0)].tiers == {"gpu": 2, "host": 0, "disk": 0, "shared": 0}
    # filtered scoring still sees the pool claimed by a worker outside the filter
    assert ix.score("m", toks(2), workers=[("idle", 0)]).workers[0].cached_blocks == 2
    ix.remove_worker("m", "a")
    assert one(ix, toks(2))[("idle", 0)].cached_blocks == 0


def test_orphan_attaches_when_parent_arrives_then_expires_otherwise(ix: KVIndex) -> None:
    st = ix.apply("m", "a", 0, batch(BlockStored([2], 1, toks(1, 4), BS)))
    assert st.counts[("stored", "GPU", "orphan_held")] == 1 and st.orphans_pending == 1
    st = ix.apply("m", "a", 0, batch(BlockStored([1], None, toks(1), BS)))
    assert st.counts[("stored", "GPU", "orphan_attached")] == 1 and st.orphans_pending == 0
    assert one(ix, toks(2))[("a", 0)].device_blocks == 2
    ix.apply("m", "a", 0, batch(BlockStored([9], 8, toks(1, 50), BS)))
    dropped = None
    for _ in range(3):
        st = ix.apply("m", "a", 0, batch())
        dropped = dropped or (st if st.orphans_dropped else None)
    assert dropped is not None and dropped.resync_needed and dropped.drops["orphan_expired"] == 1
    # never attached at the wrong place: the orphan's block is not under the root
    assert one(ix, toks(1, 50))[("a", 0)].cached_blocks == 0


def test_idempotence_and_absent_removes(ix: KVIndex) -> None:
    ev = BlockStored([1, 2], None, toks(2), BS)
    ix.apply("m", "a", 0, batch(ev))
    st = ix.apply("m", "a", 0, batch(ev))
    assert st.counts == {("stored", "GPU", "duplicate"): 2}
    st = ix.apply("m", "a", 0, batch(BlockRemoved([2], medium="CPU"), BlockRemoved([77])))
    assert st.counts == {("removed", "CPU_PINNED", "absent"): 1, ("removed", "GPU", "absent"): 1}
    assert one(ix, toks(2))[("a", 0)].device_blocks == 2


def test_bad_input_is_counted_not_raised(ix: KVIndex) -> None:
    st = ix.apply("m", "a", 0, batch(
        BlockStored([1], None, toks(1), BS, medium="TAPE"),
        BlockStored([2], None, toks(1), 8),
        BlockStored([3], None, [], 0, medium="CPU"),
        BlockStored([4, 5], None, toks(1) + [1, 2], BS),
        BlockStored([6], None, toks(1), BS, kv_cache_spec_kind="sliding_window"),
        BlockStored([7], None, ["x", None, 3, 4], BS),  # garbage tokens
        BlockStored([[1]], None, toks(1), BS),  # unhashable engine hash
        "not an event",
    ))
    assert st.drops["unknown_medium"] == 1
    assert st.drops["block_size_mismatch"] == 1
    assert st.drops["placeholder_unknown"] == 1
    assert st.drops["partial_block"] == 1
    assert st.drops["non_full_attention"] == 1
    assert st.drops.get("bad_tokens", 0) + st.drops.get("bad_event", 0) >= 3
    assert st.counts[("stored", "GPU", "new")] == 1  # block 4 only
    assert ix.apply_payload("m", "a", 0, b"\xc1garbage").drops == {"decode_malformed": 1}


def test_namespaces_lora_salt_extra_keys(ix: KVIndex) -> None:
    ix.apply("m", "a", 0, batch(BlockStored([1, 2], None, toks(2), BS, lora_name="L")))
    ix.apply("m", "b", 0, batch(BlockStored([1, 2], None, toks(2), BS, extra_keys=[None, ["img", 1]])))
    assert one(ix, toks(2))[("a", 0)].cached_blocks == 0
    assert one(ix, toks(2), lora_name="L")[("a", 0)].cached_blocks == 2
    assert one(ix, toks(2), cache_salt="s")[("a", 0)].cached_blocks == 0
    assert one(ix, toks(2))[("b", 0)].cached_blocks == 1  # token-only query stops at the mm block
    assert one(ix, toks(2), extra_keys=[None, ["img", 1]])[("b", 0)].cached_blocks == 2
    with pytest.raises(BlockSizeConflict):
        ix.ensure_model("m", 16)
    ix.ensure_model("other", 16)
    assert ix.models() == {"m": 4, "other": 16}


def test_clear_remove_dump_load(ix: KVIndex) -> None:
    for r in (0, 1):
        ix.apply("m", "a", r, batch(BlockStored([1, 2], None, toks(2), BS),
                                    BlockStored([2], None, [], 0, medium="DISK")))
    dump = msgspec.msgpack.decode(msgspec.msgpack.encode(ix.dump("m")),
                                  type=list[tuple[str, int, list[BlockStored]]])
    rebuilt = KVIndex()
    rebuilt.load_dump("m", BS, dump)
    assert rebuilt.score("m", toks(2)) == ix.score("m", toks(2))
    assert rebuilt.worker_stats("m") == ix.worker_stats("m")
    # dump events fed to apply are skipped, never misapplied
    st = KVIndex()
    st.ensure_model("m", BS)
    assert st.apply("m", "a", 0, batch(*dump[0][2])).drops == {"non_full_attention": 3}
    ix.clear_worker("m", "a", 1)
    assert ix.worker_stats("m")[("a", 1)] == {"gpu": 0, "host": 0, "disk": 0, "shared": 0}
    assert ix.worker_stats("m")[("a", 0)]["disk"] == 1
    ix.apply("m", "a", 0, batch(AllBlocksCleared()))
    assert ix.num_nodes("m") == 0
    ix.remove_worker("m", "a")
    assert ix.workers("m") == []


def test_trust_mode_skips_rehash_but_agrees() -> None:
    plain, trust = KVIndex(), KVIndex(trust_engine_hashes=True)
    for i in (plain, trust):
        i.ensure_model("m", BS)
        for w in ("a", "b"):
            i.apply("m", w, 0, batch(BlockStored([11, 12], None, toks(2), BS)))
    assert plain.score("m", toks(2)) == trust.score("m", toks(2))


@pytest.mark.parametrize("name", ["sglang", "vllm", "vllm_bytes"])
def test_wire_samples_final_state(name: str, wire_samples_dir: Path) -> None:
    expected = json.loads((wire_samples_dir / f"{name}.expected.json").read_text())
    msgs = msgspec.msgpack.decode((wire_samples_dir / f"{name}.msgpack").read_bytes())
    ix = KVIndex()
    ix.ensure_model("m", expected["block_size"])
    for widx, _topic, _seq, payload in msgs:
        st = ix.apply_payload("m", f"w{widx}", 0, payload)
        assert not st.orphans_dropped and not any(k.startswith("decode") for k in st.drops)
    canon = {"GPU": "GPU", "CPU_PINNED": "CPU_PINNED", "CPU": "CPU_PINNED"}
    dumped = {wid: {ev.medium: ev.block_hashes for ev in evs} for wid, _r, evs in ix.dump("m")}
    for wexp in expected["workers"]:
        got = dumped.get(f"w{wexp['worker']}", {})
        for medium, hashes in wexp["final"].items():
            norm = sorted(bytes.fromhex(h) if isinstance(h, str) else h & (2**64 - 1) for h in hashes)
            assert sorted(got.get(canon[medium], [])) == norm, (medium, name)
