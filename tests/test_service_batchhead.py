"""schemas.batchhead: the head the live ingest (and the offline replay) read before handing a
payload to `KVIndex.apply_payload` must agree with the full decoder wherever it answers."""
from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.batchhead import read_head
from schemas.codec import DecodeError, decode_batch, encode_batch
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

hashes = st.lists(st.integers(-(1 << 63), (1 << 64) - 1), min_size=1, max_size=4)
events = st.lists(st.one_of(
    st.builds(lambda h, t: BlockStored(block_hashes=h, parent_block_hash=None, token_ids=t * len(h), block_size=len(t)),
              hashes, st.lists(st.integers(0, 1 << 32), min_size=1, max_size=4)),
    st.builds(lambda h, m: BlockRemoved(block_hashes=h, medium=m), hashes, st.sampled_from([None, "GPU", "CPU", "ODD"])),
    st.just(AllBlocksCleared()),
), max_size=5)


@settings(max_examples=150, deadline=None)
@given(events, st.one_of(st.none(), st.integers(-3, 1 << 16)), st.floats(0, 2e9))
def test_head_matches_the_full_decoder(evs: list, rank: int | None, ts: float) -> None:
    payload = encode_batch(KVEventBatch(ts, evs, rank))
    head = read_head(payload)
    full = decode_batch(payload)
    assert head is not None and not isinstance(full, DecodeError)
    assert (head.ts, head.data_parallel_rank) == (full.ts, full.data_parallel_rank)
    assert head.event_types() == [type(e).__name__ for e in full.events]


def test_head_declines_what_only_the_full_decoder_can_judge() -> None:
    array_form = msgspec.msgpack.encode([1.0, [["BlockRemoved", [5], "GPU"]], None])
    assert read_head(array_form) is None and not isinstance(decode_batch(array_form), DecodeError)
    for bad in (b"", b"\xc1", b"\x93\xcb", msgspec.msgpack.encode([1.0, [{"type": "Nope"}], None]),
                msgspec.msgpack.encode({"ts": 1.0}), msgspec.msgpack.encode([1.0, [], "rank"])):
        assert read_head(bad) is None
        assert isinstance(decode_batch(bad), DecodeError)
    # Tags read, bodies skipped: the head reads what apply_payload must still judge.
    skipped = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "token_ids": ["x"]}], 2])
    head = read_head(skipped)
    assert head is not None and head.data_parallel_rank == 2 and head.event_types() == ["BlockStored"]
    assert isinstance(decode_batch(skipped), DecodeError)
