"""The head of a KV event batch payload: `ts`, `data_parallel_rank` and each event's type, read
without decoding any event body (token ids, hashes and the rest are skipped by msgspec, never
materialised).

Consumers that hand the payload itself to `KVIndex.apply_payload` (its fastest decoder) read
this first for what they need around the apply: dp_rank, lag, heartbeat (no events), event
counts. Used by the offline replay (`indexer.replay`) and by `KVIndex.apply_payload(...,
rank_from_batch=True)` (the live ingest's call) for payloads its C walk does not take — the C walk
reads the same dp_rank and ts itself, and tests/test_index_fastpath.py holds the two to each other.

`read_head` accepts exactly the map-form batches whose outer shape `schemas.codec.decode_batch`
accepts; it returns None for everything else (array-form events, unknown tags, malformed bytes),
and the caller then takes the full decoder, which gives the exact verdict and error label. A head
that reads does *not* prove the events decode: `apply_payload` still judges them (and reports a
`decode_*` drop when they do not).
"""
from __future__ import annotations

from typing import Union

import msgspec


class _Tag(msgspec.Struct, tag_field="type"):
    """An event with every field but its tag skipped (unknown fields are ignored)."""

    @property
    def type_name(self) -> str:
        return self.__struct_config__.tag  # type: ignore[return-value]


class _StoredTag(_Tag, tag="BlockStored"):
    pass


class _RemovedTag(_Tag, tag="BlockRemoved"):
    pass


class _ClearedTag(_Tag, tag="AllBlocksCleared"):
    pass


class BatchHead(msgspec.Struct, array_like=True):
    """`[ts, events, dp_rank]` with events reduced to their tags (same positions as KVEventBatch)."""

    ts: float
    events: list[Union[_StoredTag, _RemovedTag, _ClearedTag]]
    data_parallel_rank: Union[int, None] = None

    def event_types(self) -> list[str]:
        """Class names of the events, in order ("BlockStored", "BlockRemoved", "AllBlocksCleared")."""
        return [e.type_name for e in self.events]


_decoder = msgspec.msgpack.Decoder(BatchHead)


def read_head(payload: bytes | memoryview) -> BatchHead | None:
    """The head of a map-form batch, or None when only the full decoder can judge the payload."""
    try:
        return _decoder.decode(payload)
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError):
        return None
