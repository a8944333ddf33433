"""The native whole-batch path (`apply_msgpack`, behind `KVIndex.apply_payload`) against the pure-Python
core on random raw payloads, odd ones included (unknown / aliased / non-ASCII media, bad hashes, bad
tokens, LoRA names, real and all-None extra keys, sliding-window groups, unknown and repeated keys, tag
not first, array-form events, trailing bytes, orphans): after every batch both give identical stats and
identical state — node table, every worker's engine-hash map and pending orphans."""
from __future__ import annotations

import math
import random
import struct

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from indexer.core import native as native_core
from indexer.index import ApplyStats, KVIndex, RankLimits
from schemas.batchhead import read_head
from indexer.core.apply import decode_or_drop
from support.native_payloads import BS, MODEL, WORKERS, index_state, random_event, random_payload

pytestmark = pytest.mark.skipif(not native_core.available(), reason="native accelerator not built")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_batches=st.integers(1, 40), trust=st.booleans())
def test_fast_path_matches_python_core(seed: int, n_batches: int, trust: bool) -> None:
    rng = random.Random(seed)
    pool = [rng.getrandbits(64) - (2**63 if rng.random() < 0.3 else 0) for _ in range(10)] + [b"\x07" * 32]
    blocks = [[rng.randrange(300) for _ in range(BS)] for _ in range(4)]
    fast = KVIndex(trust_engine_hashes=trust, native=True)
    ref = KVIndex(trust_engine_hashes=trust, native=False)
    for ix in (fast, ref):
        ix.ensure_model(MODEL, BS)
    for _ in range(n_batches):
        wid, r = rng.choice(WORKERS)
        payload = random_payload(rng, pool, blocks)
        got = fast.apply_payload(MODEL, wid, r, payload)
        want = ref.apply_payload(MODEL, wid, r, payload)
        assert got == want, payload
        assert index_state(fast) == index_state(ref), payload
        if rng.random() < 0.05:
            fast.clear_worker(MODEL, wid, r)
            ref.clear_worker(MODEL, wid, r)
    q = [t for b in rng.sample(blocks, 3) for t in b]
    for lora in (None, "l"):
        assert fast.score(MODEL, q, lora_name=lora) == ref.score(MODEL, q, lora_name=lora)


def test_fast_path_takes_the_common_case_and_hands_over_at_orphans() -> None:
    """The C path really runs (a worker's later batches never reach the Python decoder) and an orphan
    mid-batch is held exactly as the Python path holds it, with the events before it applied once."""
    ix = KVIndex(native=True)
    ix.ensure_model(MODEL, BS)
    enc = msgspec.msgpack.encode
    ix.apply_payload(MODEL, "a", 0, enc([0.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                                "token_ids": [5, 6], "block_size": BS}]]))
    calls = []
    nat = ix._accel.mod

    class Spy:
        def __getattr__(self, name):
            return getattr(nat, name)

        def apply_msgpack(self, *a, **kw):
            calls.append(res := nat.apply_msgpack(*a, **kw))
            return res

    ix._accel.mod = Spy()
    batch = enc([0.0, [
        {"type": "BlockStored", "block_hashes": [2, 3], "parent_block_hash": 1, "token_ids": [7, 8, 9, 9, 4], "block_size": BS,
         "medium": "cpu"},
        {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": 77, "token_ids": [1, 1], "block_size": BS},
        {"type": "BlockRemoved", "block_hashes": [1, 42], "medium": "CPU_PINNED"},
    ]])
    st_ = ix.apply_payload(MODEL, "a", 0, batch)
    assert calls and calls[0][0] == 1  # applied event 0 in C, stopped at the orphan
    assert st_.counts == {("stored", "CPU_PINNED", "new"): 2, ("stored", "GPU", "orphan_held"): 1,
                          ("removed", "CPU_PINNED", "absent"): 2}
    assert st_.drops == {}
    assert st_.orphans_pending == 1
    score = ix.score(MODEL, [5, 6, 7, 8, 9, 9])
    assert (score.workers[0].cached_blocks, score.workers[0].tiers) == (3, {"gpu": 1, "host": 2, "disk": 0, "shared": 0})


def test_fresh_worker_registered_only_by_a_payload_that_decodes() -> None:
    ix = KVIndex(native=True)
    ix.ensure_model(MODEL, BS)
    assert ix.apply_payload(MODEL, "x", 0, b"\xc1").drops == {"decode_malformed": 1}
    assert ix.workers(MODEL) == []
    # only the Python decoder takes this one (LoRA name): the worker appears, the block is stored
    lora = msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": [4], "parent_block_hash": None,
                                          "token_ids": [1, 2], "block_size": BS, "lora_name": "l"}]])
    assert ix.apply_payload(MODEL, "y", 0, lora).counts == {("stored", "GPU", "new"): 1}
    assert ix.workers(MODEL) == [("y", 0)]
    assert ix.score(MODEL, [1, 2], lora_name="l").workers[0].device_blocks == 1


RANKS = [(), (None,), (-1,), (0,), (1,), (3,), (2**64 - 1,), ("x",)]  # () = no rank element


def _ranked_payload(rng: random.Random, pool: list, blocks: list[list[int]]) -> bytes:
    events = [random_event(rng, pool, blocks) for _ in range(rng.choice([0, 0, 1, 2, 4]))]
    ts = rng.choice([1.5, 0.0, -2.0, 7, 2**64 - 1, 1e9 + 0.25])
    raw = msgspec.msgpack.encode([ts, events, *rng.choice(RANKS)])
    if rng.random() < 0.1 and raw[1:2] == b"\xcb":  # ts as a float32, as some encoders write it
        raw = raw[:1] + b"\xca" + struct.pack(">f", 0.5) + raw[10:]
    if rng.random() < 0.03:
        raw += b"\x00"
    return raw


def _read_head_then_apply(ix: KVIndex, wid: str, default: int, payload: bytes) -> ApplyStats:
    """What ingest did before `rank_from_batch`: the head read in Python, then the apply."""
    head = read_head(payload)
    batch = None
    if head is None or not head.events:
        verdict = ApplyStats()
        batch = decode_or_drop(payload, verdict)  # the decoder's verdict, bad events judged one by one
        if batch is None:
            return verdict
        ts, raw, n = batch.ts, batch.data_parallel_rank, len(batch.events)
    else:
        ts, raw, n = head.ts, head.data_parallel_rank, len(head.events)
    rank = raw if raw is not None and raw >= 0 else default
    ts = ts if math.isfinite(ts) else 0.0
    if rank != default and rank > RankLimits().max_dp_rank and (wid, rank) not in ix.workers(MODEL):
        return ApplyStats(drops={"dp_rank_out_of_range": n} if n else {}, ts=ts, n_events=n)  # refused
    if not n:
        return ApplyStats(dp_rank=rank, ts=ts)
    st_ = ix.apply(MODEL, wid, rank, batch) if batch is not None else ix.apply_payload(MODEL, wid, rank, payload)
    st_.dp_rank, st_.ts, st_.n_events = rank, ts, n
    return st_


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_batches=st.integers(1, 30), trust=st.booleans())
def test_rank_from_batch_matches_read_head_then_apply(seed: int, n_batches: int, trust: bool) -> None:
    """`apply_payload(..., rank_from_batch=True)` (one C walk reading dp_rank and ts; the Python core's
    twin) gives exactly the stats and state of `read_head` + `apply_payload` with the rank it picks:
    the batch's dp_rank when a non-negative int (3), else the caller's (absent, None, -1); a rank above
    `RankLimits.max_dp_rank` (2**64-1) refuses the batch."""
    rng = random.Random(seed)
    pool = [rng.getrandbits(64) for _ in range(8)]
    blocks = [[rng.randrange(300) for _ in range(BS)] for _ in range(4)]
    fast, slow, ref = (KVIndex(trust_engine_hashes=trust, native=n) for n in (True, False, False))
    for ix in (fast, slow, ref):
        ix.ensure_model(MODEL, BS)
    for _ in range(n_batches):
        wid, default = rng.choice(WORKERS)
        payload = _ranked_payload(rng, pool, blocks)
        want = _read_head_then_apply(ref, wid, default, payload)
        for ix in (fast, slow):
            got = ix.apply_payload(MODEL, wid, default, payload, rank_from_batch=True)
            assert got == want, payload
            assert index_state(ix) == index_state(ref), payload
        assert fast.workers(MODEL) == ref.workers(MODEL)  # heartbeats and bad payloads register nobody


def test_rank_from_batch_cases() -> None:
    enc = msgspec.msgpack.encode
    ev = [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [5, 6], "block_size": BS}]
    ix = KVIndex(native=True)
    ix.ensure_model(MODEL, BS)
    for tail, rank in (((), 2), ((None,), 2), ((-1,), 2), ((3,), 3), ((0,), 0)):
        st_ = ix.apply_payload(MODEL, "w", 2, enc([4.25, ev, *tail]), rank_from_batch=True)
        assert (st_.dp_rank, st_.ts, st_.n_events) == (rank, 4.25, 1)
    assert sorted(ix.workers(MODEL)) == [("w", 0), ("w", 2), ("w", 3)]
    hb = ix.apply_payload(MODEL, "h", 0, enc([9.0, [], 5]), rank_from_batch=True)
    assert (hb.dp_rank, hb.ts, hb.n_events, hb.counts) == (5, 9.0, 0, {})
    assert ("h", 5) not in ix.workers(MODEL)
    bad = ix.apply_payload(MODEL, "z", 0, b"\xc1", rank_from_batch=True)
    assert (bad.dp_rank, bad.drops) == (None, {"decode_malformed": 1})


def test_array_like_events_take_the_fast_path_like_maps() -> None:
    """vLLM's array-like tagged events (`["BlockStored", hashes, parent, tokens, block_size, lora_id,
    medium, lora_name]`, every event tag, int and bytes hashes, group fields of group 0) are walked
    in C exactly as their map twins; what the walk declines is counted with its reason."""
    nat = native_core.select(True)
    enc = msgspec.msgpack.encode
    H = b"\x05" * 32
    maps = [
        {"type": "BlockStored", "block_hashes": [11, H], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
         "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockStored", "block_hashes": [13], "parent_block_hash": H, "token_ids": [5, 6], "block_size": BS,
         "lora_id": None, "medium": "cpu", "lora_name": None, "cache_salt": None, "session_id": None,
         "extra_keys": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [11, 99], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
        {"type": "BlockStored", "block_hashes": [-5], "parent_block_hash": None, "token_ids": [7, 8], "block_size": BS},
    ]
    arrays = [[e["type"], *[v for k, v in e.items() if k != "type"]] for e in maps]  # written in declaration order
    arrays[3] = ["AllBlocksCleared"]
    results = []
    for events in (maps, arrays):
        ix = KVIndex(native=True)
        ix.ensure_model(MODEL, BS)
        w = ix._models[MODEL].worker("a", 0)
        m = ix._models[MODEL]
        res = nat.apply_msgpack(enc([1.0, events]), w.ext, m.nodes, None, w.shift, BS, m.seed0, 1000)
        assert res is not None  # the C walk took the whole batch
        results.append((res, sorted(m.nodes.items(), key=repr), sorted(w.ext.items(), key=repr)))
    assert results[0] == results[1]
    before = nat.declines()
    for events, reason in (([arrays[0], maps[0]], "mixed_forms"),
                           ([["BlockStored", [1], None, [1, 2], BS, None, "GPU", "lora-x"]], "lora_or_salt"),
                           ([["BlockStored", [1], None, [1, 2]]], "malformed"),
                           ([{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
                              "block_size": BS, "vendor": 1}], "unknown_field")):
        ix = KVIndex(native=True)
        ix.ensure_model(MODEL, BS)
        w = ix._models[MODEL].worker("a", 0)
        m = ix._models[MODEL]
        assert nat.apply_msgpack(enc([1.0, events]), w.ext, m.nodes, None, w.shift, BS, m.seed0, 1000) is None
        after = nat.declines()
        assert after[reason] == before[reason] + 1, reason
        before = after
    # group events are the pure core's: the walk applies the events before the first one and stops there
    ix = KVIndex(native=True)
    ix.ensure_model(MODEL, BS)
    w = ix._models[MODEL].worker("a", 0)
    m = ix._models[MODEL]
    for events, stop in (([arrays[0], ["BlockStored", [1], None, [1, 2], BS, None, "GPU", None, None, None, None, 1,
                                       "mamba"]], 1),
                         ([arrays[0], ["BlockRemoved", [1], "GPU", 2]], 1),
                         ([["BlockStored", [1], None, [1, 2], BS, None, "GPU", None, None, None, None, 0, "mamba"]], 0)):
        res = nat.apply_msgpack(enc([1.0, events]), w.ext, m.nodes, None, w.shift, BS, m.seed0, 1000)
        assert res is not None and res[0] == stop
        res = nat.apply_msgpack(enc([1.0, [arrays[3]]]), w.ext, m.nodes, None, w.shift, BS, m.seed0, 1000, None, 0, ())
        assert res[0] == 0  # a clear of a worker with a layout: its groups are the pure core's
    assert nat.declines() == before


# every msgpack int a token array may hold: fixint, uint8/16/32 (the widths read three per load),
# uint64 and negative ints (read one at a time)
TOKEN = st.one_of(st.integers(0, 127), st.integers(128, 255), st.integers(256, 65535), st.integers(65536, 2**32 - 1),
                  st.integers(2**32, 2**64 - 1), st.integers(-2**63, -1))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bs=st.sampled_from([1, 2, 3, 5, 16, 17]), toks=st.lists(TOKEN, max_size=70), more=st.lists(TOKEN, max_size=40),
       spare=st.integers(-3, 3), group=st.booleans(), other=st.integers(-1, 69))
def test_token_ids_of_any_width_and_count_digest_like_the_pure_core(bs: int, toks: list[int], more: list[int],
                                                                    spare: int, group: bool, other: int) -> None:
    """The walk digests each full block's token ids as it reads them (no token array): any int width,
    any count (a trailing partial block is read, not digested), more or fewer hashes than full blocks,
    a chained store after it; with a sliding-window group, its store repeating the KV store's token
    array (the digests shared) or one that differs in token `other` (read anew). Held to the pure core,
    and taken by the walk whole (no decline)."""
    n = max(0, len(toks) // bs + spare)
    hs = [1000 + i for i in range(n)]
    grp = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"} if group else {}
    evs: list[dict] = [{"type": "BlockStored", "block_hashes": hs, "parent_block_hash": None, "token_ids": toks,
                        "block_size": bs, **grp}]
    if group:
        wtoks = list(toks)
        if 0 <= other < len(wtoks):
            wtoks[other] = (wtoks[other] + 1) % 2**32
        evs.append({"type": "BlockStored", "block_hashes": hs, "parent_block_hash": None, "token_ids": wtoks,
                    "block_size": bs, "group_idx": 1, "kv_cache_spec_kind": "sliding_window",
                    "kv_cache_spec_sliding_window": 4 * bs})
    if hs:
        evs.append({"type": "BlockStored", "block_hashes": [5000 + i for i in range(len(more) // bs)],
                    "parent_block_hash": hs[-1], "token_ids": more, "block_size": bs, **grp})
    payload = msgspec.msgpack.encode([0.0, evs])
    fast, ref = KVIndex(native=True), KVIndex(native=False)
    for ix in (fast, ref):
        ix.ensure_model(MODEL, bs)
    before = native_core.declines()
    assert fast.apply_payload(MODEL, "a", 0, payload) == ref.apply_payload(MODEL, "a", 0, payload)
    assert native_core.declines() == before
    assert index_state(fast) == index_state(ref)
    if all(0 <= t < 2**32 for t in toks):  # what a /score query holds
        assert fast.score(MODEL, toks) == ref.score(MODEL, toks)


@pytest.mark.parametrize("where", ["kv", "window"])
@pytest.mark.parametrize("bad", [b"\xc0", b"\xa1x", b"\xcb" + bytes(8), b"\xce\x00"])
def test_a_malformed_token_array_in_any_store_is_judged_by_the_pure_core(where: str, bad: bytes) -> None:
    """A token that is not an int (nil, a str, a float) or is cut short, in the KV store or in the
    window store that repeats its blocks: the walk declines the payload before touching anything and
    the pure core judges it (the decoder refuses the event or the batch), as for any malformed one."""
    toks = list(range(1, 9))
    kv = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": toks,
          "block_size": 4, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    win = dict(kv, group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=9)
    good = msgspec.msgpack.encode([0.0, [kv, win]])
    # the last token of the chosen event's array replaced by the raw bytes `bad`
    enc_toks = msgspec.msgpack.encode(toks)
    at = good.find(enc_toks) if where == "kv" else good.rfind(enc_toks)
    assert at > 0 and good.count(enc_toks) == 2
    payload = good[:at] + enc_toks[:-1] + bad + good[at + len(enc_toks):]
    fast, ref = KVIndex(native=True), KVIndex(native=False)
    for ix in (fast, ref):
        ix.ensure_model(MODEL, 4)
    before = native_core.declines().get("malformed", 0)
    assert fast.apply_payload(MODEL, "a", 0, payload) == ref.apply_payload(MODEL, "a", 0, payload)
    assert native_core.declines().get("malformed", 0) == before + 1
    assert index_state(fast) == index_state(ref)
