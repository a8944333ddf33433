"""Fuzzing the C accelerator on untrusted bytes against the pure-Python core (docs/index-core.md).

- `apply_payload` (the raw-payload apply, `apply_msgpack` underneath) on: hypothesis binary strings,
  byte mutations of valid payloads (truncation at every offset, flips, inserts, splices) and
  structure-aware mutations (a field deleted, duplicated or given another type, huge ints, nested
  junk, empty block_hashes with an unknown parent, keys reordered). After every payload the native
  and pure indexes hold identical state and return identical stats; neither raises; a payload refused
  whole changes nothing.
- the `/score` token-body parsers (`json_u32_array`, `msgpack_u32_array`) never answer differently
  from the typed decoder when they answer at all.
- the C entry points called with hostile Python arguments (callbacks that mutate the caller's lists,
  negative or huge slots, odd buffers, odd map keys) raise or decline, never crash.

`KVATLAS_FUZZ=long` runs many more examples; `make test-sanitize` runs this file on an ASan + UBSan build.
"""
from __future__ import annotations

import copy
import os
import random

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from indexer.core import native as native_core
from indexer.core.types import TIER_NAMES, WorkerScore
from indexer.index import ApplyStats, KVIndex
from schemas.api import U32_MAX
from support.native_payloads import BS, MODEL, WORKERS, index_state, random_payload

N = native_core.select(True)
LONG = os.environ.get("KVATLAS_FUZZ", "") == "long"
EXAMPLES = 3000 if LONG else 120
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not LONG,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
enc = msgspec.msgpack.encode


# ---------------------------------------------------------------- the differential harness

def _pair(trust: bool) -> tuple[KVIndex, KVIndex]:
    fast, ref = KVIndex(trust_engine_hashes=trust, native=True), KVIndex(trust_engine_hashes=trust, native=False)
    for ix in (fast, ref):
        ix.ensure_model(MODEL, BS)
    return fast, ref


def _seed_history(rng: random.Random, fast: KVIndex, ref: KVIndex, pool: list, blocks: list) -> None:
    """Known parents and mapped hashes, so mutations hit removes, placeholders and chains too."""
    for _ in range(3):
        wid, r = rng.choice(WORKERS)
        p = random_payload(rng, pool, blocks)
        assert fast.apply_payload(MODEL, wid, r, p) == ref.apply_payload(MODEL, wid, r, p)


def _same(fast: KVIndex, ref: KVIndex, wid: str, rank: int, payload: bytes, rank_from_batch: bool) -> ApplyStats:
    before = index_state(ref), ref.workers(MODEL)
    got = fast.apply_payload(MODEL, wid, rank, payload, rank_from_batch=rank_from_batch)
    want = ref.apply_payload(MODEL, wid, rank, payload, rank_from_batch=rank_from_batch)
    assert got == want, payload
    assert index_state(fast) == index_state(ref), payload
    assert fast.workers(MODEL) == ref.workers(MODEL), payload
    if any(k.startswith("decode_") for k in want.drops):  # refused whole: nothing changed
        assert (index_state(ref), ref.workers(MODEL)) == before, payload
    return want


def _world(seed: int) -> tuple[random.Random, list, list]:
    rng = random.Random(seed)
    pool = [rng.getrandbits(64) for _ in range(8)] + [b"\x07" * 32]
    blocks = [[rng.randrange(300) for _ in range(BS)] for _ in range(4)]
    return rng, pool, blocks


# ---------------------------------------------------------------- structure-aware mutations

class Pairs(list):
    """A msgpack map written pair by pair (so keys can repeat)."""


def _raw(o: object) -> bytes:
    if isinstance(o, Pairs):
        n = len(o)
        head = bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
        return head + b"".join(_raw(k) + _raw(v) for k, v in o)
    if isinstance(o, list) and any(isinstance(x, (Pairs, list)) for x in o):
        n = len(o)
        head = bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
        return head + b"".join(_raw(x) for x in o)
    return enc(o)


def _deep(n: int) -> msgspec.Raw:
    return msgspec.Raw(b"\x91" * n + b"\xc0")


JUNK: list = [None, True, False, 0, -1, 1.5, float("nan"), "", "GPU", "x" * 40, b"", b"\x00", [], {}, [1, [2, [3]]],
              {"a": [None, {"b": 1}]}, 2**64 - 1, -(2**63), 2**63, 1 << 32, "ＧＰＵ", "\udc80".encode("utf-8", "surrogatepass")]


def _junk(rng: random.Random) -> object:
    r = rng.random()
    if r < 0.05:
        return _deep(rng.choice([10, 200, 2000]))
    if r < 0.1:
        return [copy.deepcopy(rng.choice(JUNK[:14])) for _ in range(rng.randint(0, 40))]
    return copy.deepcopy(rng.choice(JUNK))  # a fresh object: later mutations must not change the pool


def _mutate_event(rng: random.Random, ev: object, pool: list) -> object:
    if not isinstance(ev, dict):
        return _junk(rng) if rng.random() < 0.5 else ev
    items = list(ev.items())
    op = rng.randrange(9)
    if op == 0 and items:  # delete a field (the tag too, sometimes)
        del items[rng.randrange(len(items))]
    elif op == 1 and items:  # duplicate a field, same or other value
        k, v = rng.choice(items)
        items.insert(rng.randrange(len(items) + 1), (k, v if rng.random() < 0.5 else _junk(rng)))
    elif op == 2 and items:  # swap a value's type
        i = rng.randrange(len(items))
        items[i] = (items[i][0], _junk(rng))
    elif op == 3:  # huge or edge ints where ints go
        k = rng.choice(["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "group_idx"])
        big = rng.choice([2**64 - 1, -(2**63), 2**63, 0, -1, 1 << 40])
        items.append((k, [big] * rng.randint(0, 3) if k in ("block_hashes", "token_ids") else big))
    elif op == 4:  # nested junk in an unknown field or the extra keys
        items.append((rng.choice(["junk", "extra_keys", "medium", "kv_cache_spec_kind"]), _junk(rng)))
    elif op == 5:  # empty block_hashes, unknown parent (placeholder or not)
        items = [("type", "BlockStored"), ("block_hashes", []), ("parent_block_hash", rng.getrandbits(64)),
                 ("token_ids", rng.choice([[], [1] * BS, [1]])), ("block_size", rng.choice([0, BS]))]
    elif op == 6:  # keys reordered
        rng.shuffle(items)
    elif op == 7 and items:  # a key that is not a str
        items.append((rng.choice([1, b"type", None, 1.5]), 0))
    else:  # a hash pool member where a hash goes, so a parent or remove may resolve
        items.append(("parent_block_hash", rng.choice(pool)))
    return Pairs(items)


def _mutated_payload(rng: random.Random, pool: list, blocks: list) -> bytes:
    raw = random_payload(rng, pool, blocks)
    try:
        batch = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:  # trailing bytes: mutated at the byte level instead
        return _byte_mutation(rng, raw)
    if not isinstance(batch, list) or len(batch) < 2:
        return _raw(batch)
    for _ in range(rng.randint(1, 3)):
        events = batch[1]
        r = rng.random()
        if isinstance(events, list) and events and r < 0.7:
            i = rng.randrange(len(events))
            events[i] = _mutate_event(rng, events[i], pool)
        elif r < 0.8:
            batch[0] = _junk(rng)  # ts
        elif r < 0.9:
            batch[2:] = [rng.choice([_junk(rng), 2**64 - 1, 1024, 1023, 5, -1, None])]  # dp_rank
        elif r < 0.95:
            batch[1] = _junk(rng)
        else:
            batch.append(_junk(rng))
    return _raw(batch)


def _byte_mutation(rng: random.Random, raw: bytes) -> bytes:
    b = bytearray(raw)
    r = rng.random()
    if not b:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 8)))
    i = rng.randrange(len(b))
    if r < 0.25:
        b[i] ^= 1 << rng.randrange(8)
    elif r < 0.5:  # a msgpack type byte where another was
        b[i] = rng.choice([0xC0, 0xC1, 0xC2, 0xC4, 0xCA, 0xCB, 0xCF, 0xD3, 0xD9, 0xDC, 0xDD, 0xDE, 0xDF, 0x90, 0x9F,
                           0x80, 0x8F, 0xA0, 0xBF, 0xFF, 0x7F, 0x00])
    elif r < 0.7:
        del b[i : i + rng.randint(1, 4)]
    elif r < 0.85:
        b[i:i] = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 4)))
    else:  # a length field made huge
        b[i:i] = rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdc\xff\xff", b"\xdb\x7f\xff\xff\xff", b"\xc6\xff\xff\xff\xff"])
    return bytes(b)


# ---------------------------------------------------------------- apply_payload fuzzing

@FUZZ
@given(seed=st.integers(0, 2**32 - 1), trust=st.booleans())
def test_structure_aware_mutations_agree(seed: int, trust: bool) -> None:
    rng, pool, blocks = _world(seed)
    fast, ref = _pair(trust)
    _seed_history(rng, fast, ref, pool, blocks)
    for _ in range(6):
        wid, r = rng.choice(WORKERS)
        _same(fast, ref, wid, r, _mutated_payload(rng, pool, blocks), rng.random() < 0.5)


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), trust=st.booleans())
def test_byte_mutations_agree(seed: int, trust: bool) -> None:
    rng, pool, blocks = _world(seed)
    fast, ref = _pair(trust)
    _seed_history(rng, fast, ref, pool, blocks)
    for _ in range(6):
        wid, r = rng.choice(WORKERS)
        raw = random_payload(rng, pool, blocks) if rng.random() < 0.6 else _mutated_payload(rng, pool, blocks)
        for _ in range(rng.randint(1, 3)):
            raw = _byte_mutation(rng, raw)
        _same(fast, ref, wid, r, raw, rng.random() < 0.5)


@FUZZ
@given(data=st.binary(max_size=300), prefix=st.sampled_from([b"", b"\x93\xcb" + b"\x00" * 8, b"\x92\x00\x91\x84\xa4type\xabBlockStored"]))
def test_arbitrary_bytes_agree(data: bytes, prefix: bytes) -> None:
    fast, ref = _pair(False)
    for rfb in (False, True):
        _same(fast, ref, "a", 0, prefix + data, rfb)


def test_truncation_at_every_offset_agrees() -> None:
    rng, pool, blocks = _world(11)
    payloads = [random_payload(rng, pool, blocks) for _ in range(30 if LONG else 6)]
    payloads.append(enc([1.0, [{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                                "token_ids": [1, 2, 3, 4], "block_size": BS, "medium": "cpu"},
                               {"type": "BlockRemoved", "block_hashes": [2], "medium": "cpu"},
                               {"type": "AllBlocksCleared"}], 3]))
    for raw in payloads:
        fast, ref = _pair(False)
        for i in range(len(raw) + 1):
            _same(fast, ref, "a", 0, raw[:i], i % 2 == 0)


def test_one_bad_event_never_loses_its_neighbours() -> None:
    """A batch refused by the decoder for one event (wrong field type, unknown tag, empty bytes hash,
    empty block_hashes with an unknown parent) applies its other events on both cores, counting the bad
    one where it stood; only a batch whose shell does not read is refused whole."""
    good1 = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2], "block_size": BS}
    good2 = {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": 1, "token_ids": [3, 4], "block_size": BS}
    bads = {
        "event_invalid": {"type": "BlockStored", "block_hashes": ["x"], "parent_block_hash": None, "token_ids": [1, 2],
                          "block_size": BS},
        "event_unknown_tag": {"type": "BlockEvicted", "block_hashes": [1]},
        "event_bad_hash": {"type": "BlockRemoved", "block_hashes": [b""]},
    }
    for reason, bad in bads.items():
        for native in (True, False):
            ix = KVIndex(native=native)
            ix.ensure_model(MODEL, BS)
            st_ = ix.apply_payload(MODEL, "a", 0, enc([1.0, [good1, bad, good2], 0]), rank_from_batch=True)
            assert st_.drops == {reason: 1} and st_.n_events == 3 and st_.dp_rank == 0, (reason, native)
            assert st_.counts == {("stored", "GPU", "new"): 2}
            assert ix.score(MODEL, [1, 2, 3, 4]).workers[0].device_blocks == 2
    empty = {"type": "BlockStored", "block_hashes": [], "parent_block_hash": 99, "token_ids": [1, 2], "block_size": BS}
    fast, ref = _pair(False)
    st_ = _same(fast, ref, "a", 0, enc([1.0, [good1, empty, good2]]), False)
    assert st_.drops == {} and st_.counts == {("stored", "GPU", "new"): 2}
    assert _same(fast, ref, "a", 0, enc(["x", [good1]]), False).drops == {"decode_invalid": 1}


def test_oversized_payload_is_refused_by_both_cores() -> None:
    from schemas.codec import DEFAULT_MAX_PAYLOAD

    ev = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1] * BS,
          "block_size": BS, "session_id": "s" * DEFAULT_MAX_PAYLOAD}  # a valid batch, past the cap
    big = enc([1.0, [ev], None])
    fast, ref = _pair(False)
    assert _same(fast, ref, "a", 0, big, False).drops == {"decode_too_large": 1}


# ---------------------------------------------------------------- dp_rank bounds and width shrink

def test_batch_ranks_are_bounded_and_widths_shrink() -> None:
    ev = [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2], "block_size": BS}]
    for native in (True, False):
        ix = KVIndex(native=native)
        ix.ensure_model(MODEL, BS)
        ix.register_worker(MODEL, "good", 0)
        ix.apply_payload(MODEL, "good", 0, enc([1.0, ev, 0]), rank_from_batch=True)
        # one publisher naming thousands of ranks opens at most max_ranks_per_worker of them
        refused: dict[str, int] = {}
        for r in range(1, 2000, 7):
            st_ = ix.apply_payload(MODEL, "evil", 0, enc([1.0, ev, r]), rank_from_batch=True)
            for k, v in st_.drops.items():
                refused[k] = refused.get(k, 0) + v
            assert st_.dp_rank in (None, r)
        ranks = [r for w, r in ix.workers(MODEL) if w == "evil"]
        assert len(ranks) == 64 and max(ranks) <= 1023, native
        named = range(1, 2000, 7)
        in_range = sum(1 for r in named if r <= 1023)
        assert refused == {"too_many_ranks": in_range - 64, "dp_rank_out_of_range": len(named) - in_range}
        hb = ix.apply_payload(MODEL, "evil", 0, enc([1.0, [], 5000]), rank_from_batch=True)
        assert hb.dp_rank is None and hb.drops == {}  # a refused heartbeat reports no rank
        m = ix._models[MODEL]
        if native:
            assert m.nodes.width == 5  # 65 slots: five 64-bit words per node
        ix.remove_worker(MODEL, "evil")
        assert len(m.workers) == 1 and m.slot_mask == 1
        if native:
            assert m.nodes.width == 1
        assert ix.score(MODEL, [1, 2]).workers[0].device_blocks == 1


def test_slots_compact_when_low_workers_go() -> None:
    """Workers registered after a crowd keep their blocks when the crowd goes and their slots move down."""
    ev = [{"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [5, 6], "block_size": BS,
           "medium": "cpu"}]
    for native in (True, False):
        ix = KVIndex(native=native)
        ix.ensure_model(MODEL, BS)
        for i in range(40):
            ix.register_worker(MODEL, f"crowd{i:02d}")
        ix.apply_payload(MODEL, "late", 0, enc([1.0, ev]))
        ix.apply_payload(MODEL, "crowd00", 0, enc([1.0, ev]))
        for i in range(1, 40):
            ix.remove_worker(MODEL, f"crowd{i:02d}")
        m = ix._models[MODEL]
        assert len(m.workers) == 2 and sorted(w.slot for w in m.by_id.values()) == [0, 1]
        if native:
            assert m.nodes.width == 1
        rows = {w.worker_id: (w.cached_blocks, w.tiers["host"]) for w in ix.score(MODEL, [5, 6]).workers}
        assert rows == {"late": (1, 1), "crowd00": (1, 1)}
        assert ix.worker_stats(MODEL)[("late", 0)]["host"] == 1


# ---------------------------------------------------------------- token-body parsers

_json_ref = msgspec.json.Decoder(list[int])
_mp_ref = msgspec.msgpack.Decoder(list[int])


def _check_parser(parse, ref, raw: bytes, limit: int) -> None:
    got = parse(raw, limit)
    if got is None:
        return  # undecided: the typed decoder judges the body
    vals = list(np.frombuffer(got, dtype="<u4"))
    want = ref.decode(raw)
    assert vals == want and len(want) <= limit and all(0 <= t <= U32_MAX for t in want), raw


@FUZZ
@given(toks=st.lists(st.integers(0, 9_999_999) | st.integers(-(2**63), 2**64 - 1)
                     | st.sampled_from([0, 1, U32_MAX, U32_MAX + 1, -1]), max_size=40),
       junk=st.binary(max_size=8), cut=st.integers(0, 400), limit=st.integers(0, 50), seed=st.integers(0, 2**16))
def test_token_parsers_never_disagree_with_the_typed_decoder(toks, junk, cut, limit, seed) -> None:
    rng = random.Random(seed)
    js = msgspec.json.encode(toks)
    if rng.random() < 0.3:
        js = js.replace(b",", rng.choice([b", ", b"\n,\t", b",,", b" , "]))
    mp = enc(toks)
    for raw, parse, ref in ((js, N.json_u32_array, _json_ref), (mp, N.msgpack_u32_array, _mp_ref)):
        for variant in (raw, raw[:cut], raw + junk, junk + raw, _byte_mutation(rng, raw)):
            try:
                ref.decode(variant)
            except (msgspec.DecodeError, msgspec.ValidationError):
                assert parse(variant, limit) is None, variant
                continue
            _check_parser(parse, ref, variant, limit)


def test_json_tokens_of_every_digit_count_and_position() -> None:
    # Tokens of 1-7 digits with 8 bytes readable take the word-at-a-time path, others the byte loop:
    # every digit count, a leading zero, and each distance to the body's end, against the typed decoder.
    for k in range(1, 12):
        for lead in ("", "0", "00"):
            tok = lead + "9876543210"[:k][::-1]
            for pad in range(0, 10):
                for body in ("[" + tok + "," + "5" * pad + "]", "[" + "1," * pad + tok + "]",
                             "[" + tok + " ]" + " " * pad, "[" + tok + ".5," + "7" * pad + "]"):
                    raw = body.encode()
                    try:
                        _json_ref.decode(raw)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        assert N.json_u32_array(raw, 100) is None, raw
                        continue
                    if all(0 <= t <= U32_MAX for t in _json_ref.decode(raw)):
                        assert N.json_u32_array(raw, 100) is not None, raw  # decided, not left to the decoder
                    _check_parser(N.json_u32_array, _json_ref, raw, 100)


@FUZZ
@given(data=st.binary(max_size=200), limit=st.integers(-1, 100))
def test_token_parsers_on_arbitrary_bytes(data: bytes, limit: int) -> None:
    for parse, ref in ((N.json_u32_array, _json_ref), (N.msgpack_u32_array, _mp_ref)):
        try:
            ref.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            assert parse(data, limit) is None
            continue
        _check_parser(parse, ref, data, limit)


# ---------------------------------------------------------------- hostile Python arguments

def _score(**kw):
    args = dict(nodes=N.U64Map(), keys=[5, 6], tokens=None, seed=1, block_size=1, slots=[0], worker_ids=["w"],
                ranks=[0], weights=(1.0, 0.8, 0.5, 0.4), row_type=WorkerScore, tier_names=TIER_NAMES)
    args.update(kw)
    return N.score_rows(**args)


def test_score_rows_survives_a_row_type_that_mutates_its_inputs() -> None:
    wids, ranks = ["a", "b", "c"], [0, 1, 2]

    def row(*a):
        wids.clear()
        ranks.clear()  # the C code reads its own tuples, not these lists
        return WorkerScore(*a)

    nodes = N.U64Map()
    nodes[5] = 0b1
    res = _score(nodes=nodes, slots=[0, 1, 2], worker_ids=wids, ranks=ranks, row_type=row)
    assert [(w.worker_id, w.dp_rank) for w in res[1]] == [("a", 0), ("b", 1), ("c", 2)]


def test_score_rows_refuses_bad_slots_and_names() -> None:
    class Idx:
        def __index__(self) -> int:
            return 0

    for slots in ([-1], [2**62], [Idx()], [1 << 24]):
        with pytest.raises((ValueError, OverflowError, TypeError)):
            _score(slots=slots)

    class S(str):
        def __hash__(self) -> int:
            return 1

    assert _score(tier_names=(S("gpu"), "host", "disk", "shared")) is None
    assert _score(slots=[], worker_ids=[], ranks=[])[1] == []
    assert _score(keys=[])[1][0].cached_blocks == 0


def test_hybrid_rows_declines_odd_arguments() -> None:
    """hybrid_rows (the C usable-prefix rows) answers None for any shape it does not take and raises
    only for bad slots, like score_rows; it never reads out of its tables."""
    main, g = N.U64Map(), N.U64Map()
    for k in (5, 6, 7):
        main[k] = 0b1
        g[k] = 0b1
    ok = N.hybrid_rows(main, [5, 6, 7], None, 0, 1, [(2, -1, g)], [(0,)], [0])[1]
    assert ok == [(3, 3, 3, 3, 0, 0, 0)]
    odd = [
        (main, [5, 0], [(2, -1, g)], [(0,)], [0]),           # key 0: the pure core's
        (main, [5, "x"], [(2, -1, g)], [(0,)], [0]),
        (main, [5], [(2, -1, g)], [(1,)], [0]),              # no group 1
        (main, [5], [(2, -1, g)], [(-1,)], [0]),
        (main, [5], [(2, -1, g)], [(2**70,)], [0]),
        (main, [5], [(2, -1, g)], [(0, 0)], [0]),            # more entries than groups
        (main, [5], [(3, -1, g)], [(0,)], [0]),              # no such kind
        (main, [5], [(1, -2, g)], [(0,)], [0]),
        (main, [5], [(1, 2**70, g)], [(0,)], [0]),
        (main, [5], [(1, 1, {1: 2})], [(0,)], [0]),          # not a U64Map
        (main, [5], [(1, 1, (g, g))], [(0,)], [0]),          # shards do not match the main tree's
        ((main, {}), [5], [(1, 1, g)], [(0,)], [0]),
        ({}, [5], [(1, 1, g)], [(0,)], [0]),
        (main, [5], [(1, 1, g)], [[0]], [0]),                # a layout that is not a tuple
        (main, [5], [[1, 1, g]], [(0,)], [0]),
        (main, (5,), [(1, 1, g)], [(0,)], [0]),
        (main, [5], [(1, 1, g)], [(0,), (0,)], [0]),         # layouts and slots disagree
    ]
    for main_, keys, groups, layouts, slots in odd:
        assert N.hybrid_rows(main_, keys, None, 0, 1, groups, layouts, slots) is None
    for toks, seed, bs in (([1, 2], "s", 1), ([1, 2], 0, 0), (None, 0, 1), (["x"], 0, 1), ([1.5], 0, 1)):
        assert N.hybrid_rows(main, None, toks, seed, bs, [(2, -1, g)], [(0,)], [0]) is None
    for slots in ([-1], [2**62], [1 << 24]):
        with pytest.raises((ValueError, OverflowError)):
            N.hybrid_rows(main, [5], None, 0, 1, [(2, -1, g)], [(0,)], slots)
    with pytest.raises(TypeError):
        N.hybrid_rows(main, [5])
    # shards: slot s is shard s % 2's worker s // 2; an empty dict stands for a shard without the group
    other = N.U64Map()
    other[5] = 0b10
    assert N.hybrid_rows((main, other), [5, 6], None, 0, 1, [(0, -1, (g, {}))], [(0,), ()], [0, 1])[1] == [
        (2, 2, 2, 2, 0, 0, 0), (0, 1, 1, 0, 1, 0, 0)]


def test_apply_msgpack_refuses_bad_positions_and_aliased_maps() -> None:
    raw = enc([0.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1],
                      "block_size": 1}]])
    base = dict(known=None, block_size=1, seed=1, known_limit=10)
    for shift in (-4, 3, 2**31 - 4, 4 << 20):
        try:
            res = N.apply_msgpack(raw, ext=N.U64Map(), nodes=N.U64Map(), shift=shift, **base)
        except OverflowError:
            continue
        assert res is None
    m = N.U64Map()
    with pytest.raises(ValueError):
        N.apply_msgpack(raw, ext=m, nodes=m, shift=0, **base)
    for empty in (enc([0.0, []]), enc([0.0, [{"type": "AllBlocksCleared"}]]),
                  enc([0.0, [{"type": "BlockRemoved", "block_hashes": []}]]),
                  enc([0.0, [{"type": "BlockStored", "block_hashes": [], "parent_block_hash": None, "token_ids": [],
                              "block_size": 0}]])):
        assert N.apply_msgpack(empty, ext=N.U64Map(), nodes=N.U64Map(), shift=0, **base)[0] == -1


def test_tokens_from_odd_buffers() -> None:
    nodes = N.U64Map()
    for arr in (np.arange(6, dtype=np.int32), np.arange(6, dtype=np.uint16), np.arange(6, dtype=np.int64),
                np.arange(6, dtype=">i4"), np.arange(6, dtype=np.float32), np.zeros((2, 3), dtype=np.int64),
                np.arange(12, dtype=np.int32)[::2], memoryview(b"abcdef"), bytearray(b"\x01\x02")):
        res = _score(nodes=nodes, keys=None, tokens=arr, block_size=2)
        assert res is None or res[0] == len(np.asarray(arr).reshape(-1)) // 2


def test_u64map_keys_and_wide_values() -> None:
    m = N.U64Map()

    class K(int):
        def __eq__(self, other):  # would run Python code inside a lookup
            return True

        __hash__ = int.__hash__

    for bad in (K(5), "x", 1.5, (1,), None):
        with pytest.raises(TypeError):
            m[bad] = 1
        with pytest.raises(TypeError):
            bad in m  # noqa: B015
    wide = (1 << 200) | 7
    m[3] = wide
    assert m[3] == wide and m.width == 4
    m[3] = 1
    assert m.narrow() == 1 and m[3] == 1
    with pytest.raises(OverflowError):
        m[4] = 1 << (64 * 5000)
    with pytest.raises(ValueError):
        m[4] = -(1 << 100)

    class V(int):
        def bit_length(self) -> int:  # never consulted: the unbound int methods are
            raise AssertionError

        def to_bytes(self, *a, **k):
            raise AssertionError

    m[5] = V(1 << 100)
    assert m[5] == 1 << 100
