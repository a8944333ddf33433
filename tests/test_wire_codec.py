"""Golden tests for the wire codec: engine-shaped bytes built by hand decode to the same normalised
events; encode -> decode round-trips; malformed payloads give typed errors, never exceptions."""
from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.codec import DecodeError, decode_batch, encode_batch
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

U64 = (1 << 64) - 1
enc = msgspec.msgpack.encode

# Signed int64 ids (SGLang) and the same ids as vLLM sends them (unsigned u64).
SIGNED = [-5310056818460786832, 3543888862289981337, -1]
UNSIGNED = [h & U64 for h in SIGNED]
TOKENS = list(range(100, 100 + 3 * 16))


def sglang_payload(hashes: list[int], medium: str, parent: int | None = None) -> bytes:
    # SGLang 0.5.23: tagged maps, lora_id/medium always present, no vLLM extras.
    return enc([1795297097.25, [
        {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
         "token_ids": TOKENS, "block_size": 16, "lora_id": None, "medium": medium},
        {"type": "BlockRemoved", "block_hashes": hashes[:1], "medium": medium},
        {"type": "AllBlocksCleared"},
    ], 0])


def vllm_payload(hashes: list, medium: str, parent: object = None) -> bytes:
    # vLLM 0.33: tagged maps with the hybrid-group extras, omit_defaults drops None-valued tails.
    return enc([1795297097.25, [
        {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
         "token_ids": TOKENS, "block_size": 16, "lora_id": None, "medium": medium,
         "lora_name": None, "extra_keys": [None, None, None], "group_idx": 0,
         "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": hashes[:1], "medium": medium, "group_idx": 0},
        {"type": "AllBlocksCleared"},
    ], 0])


def positional_payload(hashes: list, medium: str, parent: object = None) -> bytes:
    # Dynamo-style positional events: [tag, fields in declaration order...].
    return enc([1795297097.25, [
        ["BlockStored", hashes, parent, TOKENS, 16, None, medium],
        ["BlockRemoved", hashes[:1], medium],
        ["AllBlocksCleared"],
    ], 0])


def core(batch: KVEventBatch) -> list[tuple]:
    """Engine-independent content of a decoded batch (drops vLLM-only extras)."""
    out: list[tuple] = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            out.append(("S", tuple(ev.block_hashes), ev.parent_block_hash, tuple(ev.token_ids),
                        ev.block_size, ev.medium))
        elif isinstance(ev, BlockRemoved):
            out.append(("R", tuple(ev.block_hashes), ev.medium))
        else:
            assert isinstance(ev, AllBlocksCleared)
            out.append(("C",))
    return out


def ok(payload: bytes) -> KVEventBatch:
    res = decode_batch(payload)
    assert isinstance(res, KVEventBatch), res
    return res


def test_literal_sglang_bytes_decode() -> None:
    # Bytes written out by hand (not produced by our encoder): a positional batch holding one
    # SGLang map-form BlockRemoved with one negative int64 hash, medium CPU_PINNED, dp_rank 1.
    payload = (
        b"\x93"                                   # array(3): [ts, events, dp_rank]
        b"\xcb\x41\xda\xc0\x83\xd2\x48\x7d\xee"   # float64 ts
        b"\x91"                                   # array(1) events
        b"\x83"                                   # map(3)
        b"\xa4type\xacBlockRemoved"
        b"\xacblock_hashes\x91\xd3\xb6\x4e\xe3\x75\x1e\x80\xff\x70"  # [int64]
        b"\xa6medium\xaaCPU_PINNED"
        b"\x01"                                   # dp_rank 1
    )
    batch = ok(payload)
    assert batch.data_parallel_rank == 1
    (ev,) = batch.events
    assert isinstance(ev, BlockRemoved)
    assert ev.block_hashes == [0xB64EE3751E80FF70]  # int64 -> unsigned u64
    assert ev.medium == "CPU_PINNED"


def test_sglang_vllm_and_positional_shapes_decode_to_same_events() -> None:
    sg = core(ok(sglang_payload(SIGNED, "CPU_PINNED", parent=-7)))
    vl = core(ok(vllm_payload(UNSIGNED, "CPU", parent=(-7) & U64)))
    pos = core(ok(positional_payload(SIGNED, "CPU_TIER1", parent=-7)))
    assert sg == vl == pos
    assert sg[0][1] == tuple(UNSIGNED)
    assert sg[0][2] == (-7) & U64
    assert sg[0][5] == "CPU_PINNED"


def test_bytes_hashes_are_kept_and_gpu_aliases_normalise() -> None:
    hashes = [bytes([i]) * 32 for i in range(1, 4)]
    a = core(ok(vllm_payload(hashes, "GPU", parent=b"\x09" * 32)))
    b = core(ok(positional_payload(hashes, None, parent=b"\x09" * 32)))
    c = core(ok(sglang_payload([1, 2, 3], "DEVICE")))
    assert a == b
    assert a[0][1] == tuple(hashes) and a[0][2] == b"\x09" * 32
    assert a[0][5] == "GPU" and c[0][5] == "GPU"


@pytest.mark.parametrize("alias, canonical", [
    ("CPU", "CPU_PINNED"), ("cpu_tier1", "CPU_PINNED"), ("CPU_TIER2", "DISK"), ("NVME", "DISK"),
    ("STORAGE", "DISK"), ("SHARED", "EXTERNAL"), ("REMOTE", "EXTERNAL"), (None, "GPU"),
])
def test_medium_aliases(alias: str | None, canonical: str) -> None:
    batch = ok(enc([0.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": alias}]]))
    assert batch.events[0].medium == canonical


def test_unknown_medium_kept_verbatim_and_normalize_off_keeps_wire_values() -> None:
    batch = ok(enc([0.0, [{"type": "BlockRemoved", "block_hashes": [-2], "medium": "HBM3"}]]))
    assert batch.events[0].medium == "HBM3"
    raw = decode_batch(sglang_payload(SIGNED, "CPU"), normalize=False)
    assert isinstance(raw, KVEventBatch)
    assert raw.events[0].block_hashes == SIGNED and raw.events[0].medium == "CPU"


def test_mixed_int_and_bytes_hashes_normalise_each() -> None:
    batch = ok(enc([0.0, [{"type": "BlockRemoved", "block_hashes": [-1, b"\x01" * 32, 5]}]]))
    assert batch.events[0].block_hashes == [U64, b"\x01" * 32, 5]


def test_batch_without_dp_rank_and_empty_batch() -> None:
    assert ok(enc([1.5, []])).data_parallel_rank is None
    assert ok(enc([1, [], None])) == KVEventBatch(1.0, [], None)


def test_unknown_fields_are_ignored() -> None:
    batch = ok(enc([0.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU",
                           "future_field": {"x": [1, 2]}}], 3]))
    assert core(batch) == [("R", (1,), "GPU")]


def test_encode_decode_round_trip_in_sglang_format() -> None:
    batch = ok(vllm_payload(UNSIGNED, "CPU"))
    again = ok(encode_batch(batch))
    assert again == batch
    # Our encoder writes SGLang's shape: map events inside a positional batch.
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert isinstance(raw, list) and isinstance(raw[1][0], dict) and raw[1][0]["type"] == "BlockStored"


hashes_st = st.lists(st.one_of(st.integers(0, U64), st.binary(min_size=1, max_size=32)), max_size=6)
media_st = st.sampled_from(["GPU", "CPU_PINNED", "DISK", "EXTERNAL"])
event_st = st.one_of(
    st.builds(lambda h, p, bs, m, lora: BlockStored(h, p, list(range(len(h) * bs)), bs, None, m, lora),
              hashes_st, st.one_of(st.none(), st.integers(0, U64)), st.integers(1, 32), media_st,
              st.one_of(st.none(), st.text(max_size=8))),
    st.builds(BlockRemoved, hashes_st, media_st),
    st.just(AllBlocksCleared()),
)


@settings(max_examples=150, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False), st.lists(event_st, max_size=5),
       st.one_of(st.none(), st.integers(0, 64)))
def test_round_trip_property(ts: float, events: list, dp_rank: int | None) -> None:
    batch = KVEventBatch(ts, events, dp_rank)
    assert decode_batch(encode_batch(batch)) == batch


# --- malformed input: typed errors -----------------------------------------------------------

GOOD = sglang_payload(SIGNED, "GPU")


@pytest.mark.parametrize("payload, reason", [
    (b"", "malformed"),
    (GOOD[:-5], "malformed"),                                         # truncated
    (GOOD[: len(GOOD) // 2], "malformed"),
    (GOOD + b"\x00", "malformed"),                                    # trailing garbage
    (b"\xc1\xc1\xc1", "malformed"),                                   # never-used msgpack byte
    (b"\x93\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff", "malformed"),  # 4G-element events array
    (enc([0.0, [{"type": "BlockRemoved", "block_hashes": []}]])[:-1] + b"\xdd\xff\xff\xff\xff",
     "malformed"),                                                    # 4G-element hash list
    (enc({"ts": 0.0, "events": []}), "invalid"),                     # map instead of array
    (enc([0.0, [{"type": "BlockStored", "block_hashes": "abc", "parent_block_hash": None,
                 "token_ids": [], "block_size": 16}]]), "invalid"),   # wrong type
    (enc([0.0, [{"type": "BlockStored", "block_hashes": [1]}]]), "invalid"),  # missing fields
    (enc([0.0, [{"type": "BlockRemoved", "block_hashes": [True]}]]), "invalid"),
    (enc([0.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]]), "invalid"),
    (enc([0.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 7}]]), "invalid"),
    (enc(["now", []]), "invalid"),
    (enc([0.0, [{"type": "BlockEvicted", "block_hashes": [1]}]]), "unknown_tag"),
    (enc([0.0, [["BlockEvicted", [1]]]]), "unknown_tag"),            # positional unknown tag
    (enc([0.0, [["BlockRemoved", "x"]]]), "invalid"),                # positional wrong type
    (enc([0.0, [{"type": "BlockRemoved", "block_hashes": [b""]}]]), "bad_hash"),
    (b"\x91" * 200_000, "invalid"),                                   # deep nesting bomb
    (enc([0.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": b"",
                 "token_ids": [], "block_size": 16}]]), "bad_hash"),
])
def test_malformed_payloads_give_typed_errors(payload: bytes, reason: str) -> None:
    res = decode_batch(payload)
    assert isinstance(res, DecodeError), res
    assert res.reason == reason, res
    assert res.message


def test_oversize_payload_rejected_before_decoding() -> None:
    res = decode_batch(GOOD, max_bytes=len(GOOD) - 1)
    assert isinstance(res, DecodeError) and res.reason == "too_large"
    assert isinstance(decode_batch(GOOD, max_bytes=len(GOOD)), KVEventBatch)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    res = decode_batch(data)
    assert isinstance(res, (KVEventBatch, DecodeError))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(GOOD) - 1), st.integers(0, 255))
def test_single_byte_corruption_never_raises(pos: int, value: int) -> None:
    data = bytearray(GOOD)
    data[pos] = value
    res = decode_batch(bytes(data))
    assert isinstance(res, (KVEventBatch, DecodeError))
