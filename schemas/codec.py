"""Encode/decode KV event batches. Decoding never raises: it returns a batch or a DecodeError.

Accepted on the wire (what vLLM 0.33 / SGLang 0.5.23 / Dynamo really send):
- events as tagged maps (SGLang, vLLM) or tagged positional arrays (Dynamo-style),
- optional trailing fields omitted, unknown fields ignored,
- hashes as signed int64 (SGLang), unsigned u64 (vLLM) or raw bytes (vLLM sha256 mode).

Normalisation: int hashes become unsigned (`h & (2**64-1)`), bytes stay bytes; media aliases become
their canonical name (`CPU` -> `CPU_PINNED`, None -> `GPU`); an unknown medium is kept verbatim so
the consumer can count it rather than silently dropping it.
"""
from __future__ import annotations

from typing import Final

import msgspec

from schemas.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEvent,
    KVEventBatchArr,
)
from schemas.media import parse_medium

U64_MASK: Final = (1 << 64) - 1
DEFAULT_MAX_PAYLOAD: Final = 64 * 1024 * 1024

_map_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_arr_decoder = msgspec.msgpack.Decoder(KVEventBatchArr)
_encoder = msgspec.msgpack.Encoder()


class DecodeError(msgspec.Struct, frozen=True):
    """Why a payload could not be decoded. `reason` is a stable label for metrics."""

    reason: str  # "too_large" | "malformed" | "unknown_tag" | "invalid" | "bad_hash"
    message: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


def normalize_hash(h: int | bytes) -> int | bytes:
    return h & U64_MASK if type(h) is int else h


def _normalize_hashes(hashes: list) -> list | None:
    """Unsigned ints, bytes kept; None when a hash is empty bytes. msgpack ints always lie in
    [-2**63, 2**64-1], so masking is the only int work needed."""
    try:
        # C-level fast path: all ints (SGLang signed, vLLM unsigned). Raises TypeError for bytes.
        if not hashes or min(hashes) >= 0:
            return hashes
        return [h & U64_MASK for h in hashes]
    except TypeError:  # bytes hashes (vLLM sha256 mode), possibly mixed with ints
        if b"" in hashes:
            return None
        return [h & U64_MASK if type(h) is int else h for h in hashes]


def _normalize(batch: KVEventBatch) -> KVEventBatch | DecodeError:
    for ev in batch.events:
        if isinstance(ev, AllBlocksCleared):  # array-form twins were re-homed by _from_array_form
            continue
        hashes = _normalize_hashes(ev.block_hashes)
        if hashes is None:
            return DecodeError("bad_hash", "empty bytes hash")
        ev.block_hashes = hashes
        medium = parse_medium(ev.medium)
        if medium is not None:
            ev.medium = medium.name
        if isinstance(ev, BlockStored):
            p = ev.parent_block_hash
            if type(p) is int:
                ev.parent_block_hash = p & U64_MASK
            elif p == b"":
                return DecodeError("bad_hash", "empty bytes parent hash")
    return batch


def _from_array_form(arr: KVEventBatchArr) -> KVEventBatch:
    # Re-home positional twins onto the canonical classes (field-for-field identical).
    events: list[KVEvent] = []
    for ev in arr.events:
        if isinstance(ev, BlockStored):
            events.append(BlockStored(*(getattr(ev, f) for f in BlockStored.__struct_fields__)))
        elif isinstance(ev, BlockRemoved):
            events.append(BlockRemoved(*(getattr(ev, f) for f in BlockRemoved.__struct_fields__)))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(arr.ts, events, arr.data_parallel_rank)


def _classify(exc: Exception) -> DecodeError:
    msg = str(exc)
    # Tag value rejected: map form at `...type`, positional form at element 0 of the event array.
    if msg.startswith("Invalid value") and (msg.endswith(".type`") or msg.endswith("][0]`")):
        return DecodeError("unknown_tag", msg)
    if isinstance(exc, msgspec.ValidationError):
        return DecodeError("invalid", msg)
    return DecodeError("malformed", msg)


def decode_batch(
    payload: bytes | memoryview, *, normalize: bool = True, max_bytes: int = DEFAULT_MAX_PAYLOAD
) -> KVEventBatch | DecodeError:
    """Decode one payload (the third ZMQ frame). Returns the batch or a DecodeError; never raises."""
    if len(payload) > max_bytes:
        return DecodeError("too_large", f"payload of {len(payload)} bytes exceeds {max_bytes}")
    try:
        batch = _map_decoder.decode(payload)
    except msgspec.ValidationError as map_exc:
        try:
            batch = _from_array_form(_arr_decoder.decode(payload))
        except msgspec.ValidationError as arr_exc:
            # Report the error of the form the payload is actually in: when events are arrays,
            # the map decoder's complaint ("expected object, got array") hides the real problem.
            return _classify(arr_exc if "got `array`" in str(map_exc) else map_exc)
        except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:
            return DecodeError("malformed", str(exc))
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:
        return DecodeError("malformed", str(exc))
    if not normalize:
        return batch
    return _normalize(batch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """Encode in SGLang's format: tagged maps inside a positional batch."""
    return _encoder.encode(batch)
