"""KV event wire structs, byte-compatible with vLLM (0.33) and SGLang (0.5.23) publishers.

Events are tagged structs (tag field "type", value = class name). SGLang and vLLM encode them as
msgpack *maps*; Dynamo also accepts the positional (array) form — `schemas.codec` decodes both.
Field order matters for the positional form: it follows the engines' declarations.
Events hold only ints, bytes, strings and lists of them (never a reference cycle), so they are
not tracked by the cycle collector (`gc=False`, as SGLang declares them): a batch of thousands of
events adds nothing to every garbage-collection pass (docs/producer-events.md).
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

# Engine block ids: SGLang signed int64, vLLM unsigned u64, or 32 raw bytes (vLLM sha256 mode).
BlockHash = Union[int, bytes]


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, kw_only=False, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
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


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]

# vLLM's `kv_cache_spec_kind`: a store is indexed only for full-attention groups (MLA included).
# A kind counts as full when it contains one of these markers (case-insensitive) and none of the
# excluding ones; None (SGLang, older vLLM) means full attention. The C accelerator's copy of this
# rule is generated from these tuples (indexer/_native/wire.py, docs/index-core.md).
FULL_ATTENTION_MARKERS: tuple[str, ...] = ("full", "mla")
NOT_FULL_ATTENTION_MARKERS: tuple[str, ...] = ("sliding",)


def is_full_attention(kind: str | None) -> bool:
    """True when a store of this `kv_cache_spec_kind` belongs in the prefix index."""
    if kind is None:
        return True
    k = kind.lower()
    return any(f in k for f in FULL_ATTENTION_MARKERS) and not any(x in k for x in NOT_FULL_ATTENTION_MARKERS)


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """One published batch: positional `[ts, events, dp_rank]`."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# --- positional (array_like) twins, for decoding Dynamo-style array events -----------------------

class BlockStoredArr(BlockStored, tag="BlockStored", array_like=True):
    pass


class BlockRemovedArr(BlockRemoved, tag="BlockRemoved", array_like=True):
    pass


class AllBlocksClearedArr(AllBlocksCleared, tag="AllBlocksCleared", array_like=True):
    pass


class KVEventBatchArr(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[BlockStoredArr, BlockRemovedArr, AllBlocksClearedArr]]
    data_parallel_rank: int | None = None
