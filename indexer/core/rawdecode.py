"""Fast payload decoding for the native core: `token_ids` kept as raw msgpack (`msgspec.Raw`).

Materialising every token id as a Python int was most of the apply time; with the accelerator the
token array is hashed straight from its msgpack bytes. Media names are left as sent (the index resolves aliases when it applies). Anything this decoder does not accept exactly
like `schemas.codec.decode_batch` (array-form events, bad hashes, oversize, malformed input) returns
None and the caller takes the full decoder, so outcomes and error labels stay identical.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import msgspec

from schemas.codec import DEFAULT_MAX_PAYLOAD, U64_MASK
from schemas.events import AllBlocksCleared, BlockHash, BlockRemoved


class RawStored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    """`schemas.events.BlockStored` with `token_ids` left undecoded (same fields, same order)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class RawBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[RawStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(RawBatch)
_INT64_MIN = -(1 << 63)


def _hashes_ok(hashes: list) -> list | None:
    """Normalised hash list (unsigned ints, bytes kept), or None if the full decoder would reject it."""
    neg = False
    for h in hashes:
        if type(h) is int:
            if h < 0:
                if h < _INT64_MIN:
                    return None
                neg = True
            elif h > U64_MASK:
                return None
        elif not h:
            return None
    return [x & U64_MASK if type(x) is int else x for x in hashes] if neg else hashes


def decode_raw_unnormalised(payload: bytes | memoryview) -> RawBatch | None:
    """Decode only (hashes as sent); None when only the full decoder can judge."""
    if len(payload) > DEFAULT_MAX_PAYLOAD:
        return None
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, RecursionError):
        return None


def normalise_raw(batch: RawBatch, norm: Callable[[list], list | None] = _hashes_ok) -> RawBatch | None:
    """Normalise hashes like `decode_batch` (idempotent), or None when the full decoder would reject them.

    `norm`: hash-list check (the accelerator passes its C twin of `_hashes_ok`)."""
    for ev in batch.events:
        if type(ev) is AllBlocksCleared:
            continue
        hashes = norm(ev.block_hashes)
        if hashes is None:
            return None
        ev.block_hashes = hashes
        # media stay as sent: apply resolves aliases itself (the batch never leaves the index)
        if type(ev) is RawStored:
            p = ev.parent_block_hash
            if type(p) is int:
                if p > U64_MASK or p < _INT64_MIN:
                    return None
                ev.parent_block_hash = p & U64_MASK
            elif p == b"":
                return None  # the full decoder rejects the batch (bad_hash)
    return batch


def decode_raw(payload: bytes | memoryview, norm: Callable[[list], list | None] = _hashes_ok) -> RawBatch | None:
    """Decode and normalise like `decode_batch`, or None when only the full decoder can judge."""
    batch = decode_raw_unnormalised(payload)
    return None if batch is None else normalise_raw(batch, norm)
