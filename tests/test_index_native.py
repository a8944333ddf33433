"""The C accelerator against its pure-Python twins: U64Map behaves like a dict, hashing agrees bit for
bit, the fast payload path judges bad input exactly like the full decoder, and the switch works."""
from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest

from indexer import hashing as H
from indexer.core import native as native_core
from indexer.core.types import TIER_NAMES, WorkerScore
from indexer.index import KVIndex
from schemas.codec import encode_batch
from schemas.events import BlockRemoved, BlockStored, KVEventBatch

N = native_core.select(True) if native_core.available() else None
pytestmark = pytest.mark.skipif(not native_core.available(), reason="native accelerator not built")
MASK = (1 << 64) - 1


def test_u64map_matches_dict_under_random_ops() -> None:
    rng = random.Random(7)
    m, d = N.U64Map(), {}
    # Few distinct keys and many deletes: long probe chains, wrap-around and backward-shift deletion.
    pool = [rng.getrandbits(64) for _ in range(3000)] + [0, 1, MASK, b"\x01" * 32, b"x", -5]
    for step in range(40_000):
        k = rng.choice(pool)
        op = rng.random()
        if op < 0.5:
            v = rng.choice([0, 1, rng.getrandbits(64), rng.getrandbits(130), 1 << 127])
            m[k] = v
            d[k] = v
        elif op < 0.8:
            if k in d:
                del m[k]
                del d[k]
            else:
                with pytest.raises(KeyError):
                    del m[k]
        else:
            assert m.get(k) == d.get(k)
            assert m.get(k, "dflt") == d.get(k, "dflt")
            assert (k in m) == (k in d)
        if step % 5000 == 0:
            assert len(m) == len(d)
    assert len(m) == len(d)
    assert sorted(m.items(), key=repr) == sorted(d.items(), key=repr)
    assert sorted(m.keys(), key=repr) == sorted(d, key=repr)
    assert sorted(m.values()) == sorted(d.values())
    assert m.width >= 3  # 130-bit values widened it
    m.clear()
    assert len(m) == 0 and m.get(pool[0]) is None


def test_u64map_big_tables_like_a_dict() -> None:
    """Tables of 2 MB and more are their own aligned mappings of whole 2 MB pages (u64map.c
    tab_alloc): grown, widened, narrowed, shrunk by deletes and cleared past that size, the map still
    holds exactly what a dict holds (the ASan build checks the accesses; docs/service.md, "Tables")."""
    rng = random.Random(11)
    m, d = N.U64Map(), {}
    keys = [rng.getrandbits(64) | 1 for _ in range(200_000)]  # 16-byte entries: ~3-5 MB tables
    for i, k in enumerate(keys):
        m[k] = d[k] = i
    wide = keys[::997]
    for k in wide:  # a 2-word value re-lays the whole table wider (24-byte entries)
        m[k] = d[k] = (1 << 100) | d[k]
    assert m.width == 2 and len(m) == len(d)
    for k in keys[::3]:
        del m[k]
        del d[k]
    for k in wide:
        if k in d:
            m[k] = d[k] = d[k] & MASK
    assert m.narrow() == 1
    assert len(m) == len(d) and all(m.get(k) == d.get(k) for k in keys)
    assert sorted(m.items()) == sorted(d.items())
    m.clear()
    assert len(m) == 0 and m.get(keys[1]) is None


def test_u64map_rejects_bad_values() -> None:
    m = N.U64Map()
    with pytest.raises(ValueError):
        m[5] = -1
    with pytest.raises(TypeError):
        m[5] = "x"
    with pytest.raises(KeyError):
        m[5]
    assert len(m) == 0


def _score_depth(nodes, tokens, bs: int, seed: int) -> int:
    res = N.score_rows(nodes, keys=None, tokens=tokens, seed=seed, block_size=bs, slots=[0], worker_ids=["w"], ranks=[0],
                       weights=(1.0, 0.8, 0.5, 0.4), row_type=WorkerScore, tier_names=TIER_NAMES)
    return res[1][0].device_blocks


def test_hashing_native_equals_python() -> None:
    """The C hashing (tokens of a query, token arrays of a raw payload) gives the pure core's keys bit for bit."""
    rng = np.random.default_rng(3)
    for bs in (1, 4, 16, 64):
        toks = rng.integers(-(2**63), 2**63 - 1, size=bs * 9 + 3, dtype=np.int64)
        seed = H.namespace_seed(bs, "l", None)
        want = H.chain_keys_py(toks.tolist(), bs, seed)
        nodes = N.U64Map()
        for k in want:
            nodes[k] = 1  # slot 0 on GPU: a query whose keys all match scores every block
        for form in (toks.tolist(), toks, tuple(toks.tolist())):
            assert _score_depth(nodes, form, bs, seed) == len(want)
        small = rng.integers(0, 2**31, size=bs * 5, dtype=np.int64)
        nodes = N.U64Map()
        for k in H.chain_keys_py(small.tolist(), bs, seed):
            nodes[k] = 1
        for dt in (np.uint32, np.int32, np.uint64):
            assert _score_depth(nodes, small.astype(dt), bs, seed) == 5
        # msgpack token arrays in a payload: every int width msgpack uses, signed and unsigned
        for arr in (toks.tolist(), small.tolist(), [0, 1, 127, 128, 255, 256, 65535, 65536, -1, -32, -33, -200,
                                                     -40000, -(2**40), 2**64 - 1, 2**63] * bs):
            n = len(arr) // bs
            payload = encode_batch(KVEventBatch(0.0, [BlockStored(list(range(1, n + 1)), None, arr, bs)]))
            ext, nodes = N.U64Map(), N.U64Map()
            s0 = H.namespace_seed(bs)
            res = N.apply_msgpack(payload, ext=ext, nodes=nodes, known=None, shift=0, block_size=bs, seed=s0,
                                  known_limit=10)
            assert res[0] == -1
            pure = H.chain_keys_py([t & MASK for t in arr], bs, s0)
            assert [ext[h] for h in range(1, n + 1)] == pure
    # what it cannot judge goes back to the Python path
    assert N.score_rows(N.U64Map(), keys=None, tokens=[1, 2**64], seed=1, block_size=1, slots=[], worker_ids=[],
                        ranks=[], weights=(1.0, 1.0, 1.0, 1.0), row_type=WorkerScore, tier_names=TIER_NAMES) is None
    assert N.score_rows(N.U64Map(), keys=None, tokens=np.array([1.0, 2.0]), seed=1, block_size=1, slots=[],
                        worker_ids=[], ranks=[], weights=(1.0, 1.0, 1.0, 1.0), row_type=WorkerScore,
                        tier_names=TIER_NAMES) is None
    bad = msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                         "token_ids": [1, 1.5], "block_size": 1}], None])
    assert N.apply_msgpack(bad, ext=N.U64Map(), nodes=N.U64Map(), known=None, shift=0, block_size=1, seed=1,
                           known_limit=10) is None


@pytest.mark.parametrize("native", [False, True])
def test_odd_payloads_judged_like_full_decoder(native: bool) -> None:
    ix = KVIndex(native=native)
    ix.ensure_model("m", 2)
    good = encode_batch(KVEventBatch(0.0, [BlockStored([-3, 2**64 - 1], -7, [1, 2, 3, 4], 2, medium="CPU")]))
    st = ix.apply_payload("m", "a", 0, good)
    assert st.counts == {("stored", "CPU_PINNED", "orphan_held"): 2}
    bad_tokens = msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                                 "token_ids": [1, "x"], "block_size": 2}], None])
    assert ix.apply_payload("m", "a", 0, bad_tokens).drops == {"event_invalid": 1}  # judged alone
    bad_hash = msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": [b""]}], None])
    assert ix.apply_payload("m", "a", 0, bad_hash).drops == {"event_bad_hash": 1}
    assert ix.apply_payload("m", "a", 0, b"\x92\xa1x\x90").drops == {"decode_invalid": 1}  # the shell itself
    arr_form = msgspec.msgpack.encode([0.0, [["BlockStored", [5], None, [1, 2], 2]], None])
    assert ix.apply_payload("m", "a", 0, arr_form).counts == {("stored", "GPU", "new"): 1}
    st = ix.apply_payload("m", "a", 0, encode_batch(KVEventBatch(0.0, [BlockRemoved([5, 6], medium="GPU")])))
    assert st.counts == {("removed", "GPU", "removed"): 1, ("removed", "GPU", "absent"): 1}
    assert ix.score("m", [1, 2, 9]).workers[0].device_blocks == 0


def test_switch_env_and_flag(monkeypatch) -> None:
    monkeypatch.delenv(native_core.ENV_PURE, raising=False)
    assert KVIndex().native is True
    assert KVIndex(native=False).native is False
    monkeypatch.setenv(native_core.ENV_PURE, "1")
    assert KVIndex().native is False
    assert KVIndex(native=True).native is True
