"""The one event recorder every producer cache class uses (design §3).

It turns tier changes into SGLang-compatible KV events, coalesces consecutive pages into one
event, and hands whole batches to a sink at `flush`. Heartbeats (empty batches) go out when a
flush finds nothing to send and the sink has been idle for `heartbeat_interval_s`. No I/O of its
own and no clock: the caller passes `now`.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, Union, cast

import msgspec

from producer import page_hash
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from schemas.media import Medium

log = logging.getLogger(__name__)

# SGLang's tier names on the wire. The bytes captured from SGLang 0.5.23 (shared/wire-samples) say
# `GPU` and `CPU_PINNED`; local and shared L3 use the canonical `DISK` / `EXTERNAL`. Every name here
# and every alias (`CPU_TIER1`, `CPU_TIER2`, ...) parses with schemas.media.
SGLANG_MEDIA: Mapping[Medium, str] = {
    Medium.GPU: "GPU",
    Medium.CPU_PINNED: "CPU_PINNED",
    Medium.DISK: "DISK",
    Medium.EXTERNAL: "EXTERNAL",
}
CANONICAL_MEDIA: Mapping[Medium, str] = {m: m.name for m in Medium}


class EventSink(Protocol):
    """Where batches go (producer/sinks.py). Two declared capabilities: a sink with `encodes_events`
    only ever sends the msgpack of a batch (schemas.codec.encode_batch of KVEventBatch(batch_ts(),
    events, dp_rank)): it also has `batch_ts() -> float` and `send_payload(bytes)`, and the recorder
    may hand it the encoded bytes directly (docs/producer-events.md); a sink without
    `asks_snapshots` never answers True to `snapshot_requested`, so the recorder does not poll it."""

    encodes_events: bool
    asks_snapshots: bool

    def emit(self, events: list[KVEvent], dp_rank: int | None) -> None: ...
    def heartbeat(self, dp_rank: int | None) -> None: ...
    def snapshot_requested(self) -> bool: ...
    def close(self) -> None: ...


class _Ids:
    """A pending record's block ids: a list of ints, or the tree's digest blobs (`dlen` bytes per
    page; an id is a digest's first 8 bytes, big-endian signed) read only when the batch is built."""

    __slots__ = ("ids", "blobs", "dlen")

    def __init__(self, ids: list[int] | None, blobs: list[bytes] | None, dlen: int) -> None:
        self.ids = ids
        self.blobs = blobs
        self.dlen = dlen

    def add_ids(self, ids: Sequence[int]) -> None:
        self.int_ids().extend(ids)

    def add_blob(self, blob: bytes, dlen: int) -> None:
        if self.blobs is not None and self.dlen == dlen:
            self.blobs.append(blob)
        else:
            self.int_ids().extend(page_hash.ids_of(blob, dlen))

    def int_ids(self) -> list[int]:
        """The ids as ints (a record given both kinds keeps ints from then on)."""
        if self.blobs is not None:
            self.ids = [i for b in self.blobs for i in page_hash.ids_of(b, self.dlen)]
            self.blobs = None
        return self.ids  # type: ignore[return-value]


class _Store(_Ids):
    """A pending `BlockStored`: its token ids stay the nodes' own key tuples (chunks) until the
    flush encodes them straight from there (no per-insert copy of the token ids). `last` is the
    last block's id (coalescing)."""

    __slots__ = ("parent", "chunks", "block_size", "medium", "group_idx", "kind", "window", "last")

    def __init__(self, ids: list[int] | None, blobs: list[bytes] | None, dlen: int, last: int,
                 parent: int | None, chunks: list[Sequence[int]], block_size: int, medium: str,
                 group_idx: int | None, kind: str | None, window: int | None) -> None:
        super().__init__(ids, blobs, dlen)
        self.last = last
        self.parent = parent
        self.chunks = chunks
        self.block_size = block_size
        self.medium = medium
        self.group_idx = group_idx
        self.kind = kind
        self.window = window

    def event(self) -> BlockStored:
        chunks = self.chunks
        tokens = list(chunks[0]) if len(chunks) == 1 else list(itertools.chain.from_iterable(chunks))
        ids: list[Any] = self.int_ids()  # the event field is list[int | bytes]: ints are one
        if self.group_idx is None and self.kind is None and self.window is None:
            return BlockStored(ids, self.parent, tokens, self.block_size, None, self.medium)
        return BlockStored(ids, self.parent, tokens, self.block_size, None, self.medium,
                           group_idx=self.group_idx, kv_cache_spec_kind=self.kind,
                           kv_cache_spec_sliding_window=self.window)


class _Removed(_Ids):
    """A pending `BlockRemoved`."""

    __slots__ = ("medium", "group_idx")

    def __init__(self, ids: list[int] | None, blobs: list[bytes] | None, dlen: int, medium: str,
                 group_idx: int | None) -> None:
        super().__init__(ids, blobs, dlen)
        self.medium = medium
        self.group_idx = group_idx

    def event(self) -> BlockRemoved:
        ids: list[Any] = self.int_ids()  # the event field is list[int | bytes]: ints are one
        if self.group_idx is None:
            return BlockRemoved(ids, self.medium)
        return BlockRemoved(ids, self.medium, group_idx=self.group_idx)


class _Cleared:
    """A pending `AllBlocksCleared`."""

    __slots__ = ()

    def event(self) -> AllBlocksCleared:
        return AllBlocksCleared()


_Record = Union[_Store, _Removed, _Cleared]

_BATCH_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def _records_of(payload: bytes) -> list[_Record]:
    """The pending records a native batch's bytes describe (`Batch.take`), so recording can go on
    in Python with the same coalescing (the rare path: a value the batch declined)."""
    out: list[_Record] = []
    for e in _BATCH_DECODER.decode(payload).events:
        # the C batch writes int ids, an int parent and a medium name (what the recorder gave it)
        if type(e) is BlockStored:
            ids = cast("list[int]", list(e.block_hashes))
            out.append(_Store(ids, None, 0, ids[-1], cast("int | None", e.parent_block_hash), [tuple(e.token_ids)],
                              e.block_size, cast(str, e.medium), e.group_idx, e.kv_cache_spec_kind,
                              e.kv_cache_spec_sliding_window))
        elif type(e) is BlockRemoved:
            out.append(_Removed(cast("list[int]", list(e.block_hashes)), None, 0, cast(str, e.medium), e.group_idx))
        else:
            out.append(_Cleared())
    return out


class EventRecorder:
    """Buffers events between flushes. `enabled=False` makes every call a no-op (and lets the
    cache skip hashing); a recorder without a sink just drops what it would send. For a sink that
    only sends bytes the buffer is the C helper's `Batch` (events encoded as they are recorded),
    else Python records (docs/producer-events.md); the bytes on the wire are the same."""

    __slots__ = ("sink", "enabled", "dp_rank", "names", "heartbeat_interval_s", "_batch", "batch", "_ask",
                 "_pending", "_last_sent", "events_emitted", "batches_sent", "heartbeats_sent")

    def __init__(self, sink: EventSink | None = None, *, enabled: bool = True, dp_rank: int | None = None,
                 media_names: Mapping[Medium, str] = SGLANG_MEDIA, heartbeat_interval_s: float = 1.0,
                 native: bool | None = None) -> None:
        missing = [m.name for m in Medium if m not in media_names]
        if missing:
            raise ValueError(f"media_names lacks a wire name for {missing}")
        self.sink = sink
        self.enabled = enabled
        self.dp_rank = dp_rank
        self.names = dict(media_names)
        self.heartbeat_interval_s = heartbeat_interval_s
        # A sink that only sends bytes (EventSink) gets its pending events in the C helper's `Batch`,
        # encoded as they are recorded (one C call per event, a memcpy per flush); `native` as in
        # producer.page_hash: None = the helper unless KVATLAS_PURE_PYTHON=1, False = never.
        # `_pending` (Python records, event structs encoded by msgspec at the flush) takes over
        # until the next flush when the batch declines a value, and serves every other sink.
        mod = page_hash.native_module(native)
        encodes = mod is not None and sink is not None and sink.encodes_events
        # `batch` is the Batch while it is the one recording (None otherwise): a cache may record
        # into it directly (producer.cache.emitter), falling back to these methods if it raises.
        self._batch: Any = mod.Batch() if mod is not None and encodes and enabled else None
        self.batch: Any = self._batch
        # A sink that says it never asks for a snapshot (`asks_snapshots = False`) is not polled.
        self._ask: Callable[[], bool] | None = (sink.snapshot_requested if enabled and sink is not None
                                                and sink.asks_snapshots else None)
        self._pending: list[_Record] = []
        self._last_sent: float | None = None
        self.events_emitted = 0
        self.batches_sent = 0
        self.heartbeats_sent = 0

    # -- recording -----------------------------------------------------------------------------
    def stored(self, ids: Sequence[int], parent_id: int | None, tokens: Sequence[int], block_size: int,
               medium: Medium, *, group_idx: int | None = None, kind: str | None = None,
               window: int | None = None) -> None:
        """`group_idx` / `kind` / `window` are vLLM's KV-cache-group fields (docs/hybrid.md); left
        None they are omitted on the wire (SGLang's shape). The native batch packs `tokens` at
        once; Python records keep them until the flush (a tuple as given, anything else copied)."""
        if not self.enabled or not ids:
            return
        b = self.batch
        if b is not None:
            try:
                b.stored_ids(ids, parent_id, tokens, block_size, self.names[medium], group_idx, kind, window)
                return
            except (TypeError, OverflowError):
                self._demote()
        last = self._continues(parent_id, self.names[medium], block_size, group_idx, kind)
        if last is not None:
            last.add_ids(ids)
            last.last = ids[-1]
            last.chunks.append(tokens if type(tokens) is tuple else tuple(tokens))
            return
        self._pending.append(_Store(list(ids), None, 0, ids[-1], parent_id,
                                    [tokens if type(tokens) is tuple else tuple(tokens)], block_size,
                                    self.names[medium], group_idx, kind, window))

    def stored_digests(self, digests: bytes, dlen: int, parent_id: int | None, tokens: tuple[int, ...],
                       block_size: int, medium: Medium, *, group_idx: int | None = None,
                       kind: str | None = None, window: int | None = None) -> None:
        """`stored` with the ids given as a tree node's digests (`dlen` bytes per page): the ids
        are written straight from them (docs/producer-events.md)."""
        if not self.enabled or not digests:
            return
        b = self.batch
        if b is not None:
            try:
                b.stored_digests(digests, dlen, parent_id, tokens, block_size, self.names[medium], group_idx, kind,
                                 window)
                return
            except (TypeError, OverflowError):
                self._demote()
        last_id = int.from_bytes(digests[len(digests) - dlen:len(digests) - dlen + 8], "big", signed=True)
        name = self.names[medium]
        last = self._continues(parent_id, name, block_size, group_idx, kind)
        if last is not None:
            last.add_blob(digests, dlen)
            last.last = last_id
            last.chunks.append(tokens if type(tokens) is tuple else tuple(tokens))
            return
        self._pending.append(_Store(None, [digests], dlen, last_id, parent_id,
                                    [tokens if type(tokens) is tuple else tuple(tokens)], block_size,
                                    name, group_idx, kind, window))

    def _demote(self) -> None:
        """Move what the native batch holds to Python records, which record until the next flush
        (only for values no producer path records: ids beyond 64 bits, non-int tokens from a caller)."""
        log.debug("native batch declined a value; Python records (msgspec) until the next flush")
        b = self._batch
        self.batch = None
        if len(b):
            self._pending = _records_of(b.take(0.0, None))

    def _continues(self, parent_id: int | None, name: str, block_size: int, group_idx: int | None,
                   kind: str | None) -> _Store | None:
        """The pending store a new one coalesces into: the same tier and group continuing the
        chain the previous store ended."""
        pending = self._pending
        if not pending or parent_id is None:
            return None
        last = pending[-1]
        if (type(last) is _Store and last.last == parent_id and last.medium == name
                and last.block_size == block_size and last.group_idx == group_idx and last.kind == kind):
            return last
        return None

    def removed(self, ids: Sequence[int], medium: Medium, *, group_idx: int | None = None) -> None:
        if not self.enabled or not ids:
            return
        b = self.batch
        if b is not None:
            try:
                b.removed_ids(ids, self.names[medium], group_idx)
                return
            except (TypeError, OverflowError):
                self._demote()
        name = self.names[medium]
        last = self._removed_tail(name, group_idx)
        if last is not None:
            last.add_ids(ids)
            return
        self._pending.append(_Removed(list(ids), None, 0, name, group_idx))

    def removed_digests(self, digests: bytes, dlen: int, medium: Medium, *, group_idx: int | None = None) -> None:
        """`removed` with the ids given as a tree node's digests (see `stored_digests`)."""
        if not self.enabled or not digests:
            return
        b = self.batch
        if b is not None:
            try:
                b.removed_digests(digests, dlen, self.names[medium], group_idx)
                return
            except (TypeError, OverflowError):
                self._demote()
        name = self.names[medium]
        last = self._removed_tail(name, group_idx)
        if last is not None:
            last.add_blob(digests, dlen)
            return
        self._pending.append(_Removed(None, [digests], dlen, name, group_idx))

    def _removed_tail(self, name: str, group_idx: int | None) -> _Removed | None:
        """The pending remove a new one of the same tier and group coalesces into."""
        pending = self._pending
        if pending:
            last = pending[-1]
            if type(last) is _Removed and last.medium == name and last.group_idx == group_idx:
                return last
        return None

    def cleared(self) -> None:
        if not self.enabled:
            return
        # Everything before a clear is moot for a consumer that applies the batch in order,
        # but it is kept: the batch must describe what happened, not a summary of it.
        if self.batch is not None:
            self.batch.cleared()
        else:
            self._pending.append(_Cleared())

    def snapshot_requested(self) -> bool:
        """Has a consumer asked (through the sink) for the full state to be re-published?"""
        ask = self._ask
        return ask is not None and self.sink is not None and bool(ask())

    @property
    def pending(self) -> int:
        return len(self._pending) + (len(self._batch) if self._batch is not None else 0)

    # -- sending -------------------------------------------------------------------------------
    def flush(self, now: float) -> int:
        """Send buffered events as one batch; if none and the sink has been idle for the
        heartbeat interval, send an empty batch. Returns the number of events sent."""
        b = self.batch
        if b is not None and self.enabled:
            n = len(b)
            if n:  # (a native batch implies a sink)
                sink = self.sink
                sink.send_payload(b.take(sink.batch_ts(), self.dp_rank))  # type: ignore[union-attr]
                self._last_sent = now
                self.events_emitted += n
                self.batches_sent += 1
                return n
        self.batch = self._batch  # after a demotion (_demote): the native batch records again
        if not self.enabled or self.sink is None:
            self._pending.clear()
            if self._batch is not None:
                self._batch.clear()
            return 0
        if self._pending:
            pending, self._pending = self._pending, []
            self._send(pending)
            self._last_sent = now
            self.events_emitted += len(pending)
            self.batches_sent += 1
            return len(pending)
        if self._last_sent is None or now - self._last_sent >= self.heartbeat_interval_s:
            self.sink.heartbeat(self.dp_rank)
            self._last_sent = now
            self.heartbeats_sent += 1
        return 0

    def _send(self, pending: list[_Record]) -> None:
        self.sink.emit([r.event() for r in pending], self.dp_rank)  # type: ignore[union-attr]

    def close(self, now: float) -> None:
        self.flush(now)
        if self.sink is not None:
            self.sink.close()
