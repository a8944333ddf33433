"""The one event recorder every producer cache class uses (design §3).

It turns tier changes into SGLang-compatible KV events, coalesces consecutive pages into one
event, and hands whole batches to a sink at `flush`. Heartbeats (empty batches) go out when a
flush finds nothing to send and the sink has been idle for `heartbeat_interval_s`. No I/O of its
own and no clock: the caller passes `now`.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec

from producer import page_hash
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from schemas.media import Medium

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
    """Where batches go. A sink whose class sets `encodes_events = True` only ever msgpack-encodes
    the events it is given (schemas.codec); it receives each store's `token_ids` already encoded,
    as a `msgspec.Raw` that encodes to the same bytes (docs/producer-events.md)."""

    def emit(self, events: list[KVEvent], dp_rank: int | None) -> None: ...
    def heartbeat(self, dp_rank: int | None) -> None: ...
    def snapshot_requested(self) -> bool: ...
    def close(self) -> None: ...


def _pack_tokens_py(chunks: list[Sequence[int]]) -> bytes:
    return msgspec.msgpack.encode(list(itertools.chain.from_iterable(chunks)))


def _native_packer(pack_ints: Callable[[list[Sequence[int]]], bytes]) -> Callable[[list[Sequence[int]]], bytes]:
    """The C helper's packer; msgspec for anything it does not take, so the bytes are always
    msgspec's (tokens the page hash accepted are u32 ints, which it always takes)."""
    def pack(chunks: list[Sequence[int]]) -> bytes:
        try:
            return pack_ints(chunks)
        except (TypeError, OverflowError):
            return _pack_tokens_py(chunks)
    return pack


class _Store:
    """A pending `BlockStored`: its token ids stay the nodes' own key tuples (chunks) until the
    flush builds the event — a list for sinks that read events, encoded bytes for sinks that
    send them (no per-insert copy of the token ids)."""

    __slots__ = ("ids", "parent", "chunks", "block_size", "medium", "group_idx", "kind", "window")

    def __init__(self, ids: list[int], parent: int | None, chunks: list[Sequence[int]], block_size: int,
                 medium: str, group_idx: int | None, kind: str | None, window: int | None) -> None:
        self.ids = ids
        self.parent = parent
        self.chunks = chunks
        self.block_size = block_size
        self.medium = medium
        self.group_idx = group_idx
        self.kind = kind
        self.window = window

    def event(self, encoded: bool, pack: Callable[[list[Sequence[int]]], bytes]) -> BlockStored:
        chunks = self.chunks
        if encoded:
            tokens: Any = msgspec.Raw(pack(chunks))
        elif len(chunks) == 1:
            tokens = list(chunks[0])
        else:
            tokens = list(itertools.chain.from_iterable(chunks))
        if self.group_idx is None and self.kind is None and self.window is None:
            return BlockStored(self.ids, self.parent, tokens, self.block_size, None, self.medium)
        return BlockStored(self.ids, self.parent, tokens, self.block_size, None, self.medium,
                           group_idx=self.group_idx, kv_cache_spec_kind=self.kind,
                           kv_cache_spec_sliding_window=self.window)


class EventRecorder:
    """Buffers events between flushes. `enabled=False` makes every call a no-op (and lets the
    cache skip hashing); a recorder without a sink just drops what it would send."""

    __slots__ = ("sink", "enabled", "dp_rank", "names", "heartbeat_interval_s", "_encoded", "_pack",
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
        # Sinks that only encode get token ids pre-encoded (EventSink); `native` as in
        # producer.page_hash: None = the C helper unless KVATLAS_PURE_PYTHON=1, False = msgspec.
        self._encoded = bool(getattr(sink, "encodes_events", False))
        mod = page_hash.native_module(native)
        self._pack = _native_packer(mod.pack_ints) if mod is not None else _pack_tokens_py
        self._pending: list[_Store | KVEvent] = []
        self._last_sent: float | None = None
        self.events_emitted = 0
        self.batches_sent = 0
        self.heartbeats_sent = 0

    # -- recording -----------------------------------------------------------------------------
    def stored(self, ids: Sequence[int], parent_id: int | None, tokens: Sequence[int], block_size: int,
               medium: Medium, *, group_idx: int | None = None, kind: str | None = None,
               window: int | None = None) -> None:
        """`group_idx` / `kind` / `window` are vLLM's KV-cache-group fields (docs/hybrid.md); left
        None they are omitted on the wire (SGLang's shape). `tokens` is kept until the flush: a
        tuple as given (the tree's keys), anything else copied."""
        if not self.enabled or not ids:
            return
        name = self.names[medium]
        if type(tokens) is not tuple:
            tokens = tuple(tokens)
        pending = self._pending
        if pending:
            last = pending[-1]
            # Coalesce: the same tier and group continuing the chain the previous store ended.
            if (type(last) is _Store and last.medium == name and last.block_size == block_size
                    and parent_id is not None and last.ids[-1] == parent_id
                    and last.group_idx == group_idx and last.kind == kind):
                last.ids.extend(ids)
                last.chunks.append(tokens)
                return
        pending.append(_Store(list(ids), parent_id, [tokens], block_size, name, group_idx, kind, window))

    def removed(self, ids: Sequence[int], medium: Medium, *, group_idx: int | None = None) -> None:
        if not self.enabled or not ids:
            return
        name = self.names[medium]
        pending = self._pending
        if pending:
            last = pending[-1]
            if type(last) is BlockRemoved and last.medium == name and last.group_idx == group_idx:
                last.block_hashes.extend(ids)
                return
        pending.append(BlockRemoved(list(ids), name) if group_idx is None
                       else BlockRemoved(list(ids), name, group_idx=group_idx))

    def cleared(self) -> None:
        if not self.enabled:
            return
        # Everything before a clear is moot for a consumer that applies the batch in order,
        # but it is kept: the batch must describe what happened, not a summary of it.
        self._pending.append(AllBlocksCleared())

    def snapshot_requested(self) -> bool:
        """Has a consumer asked (through the sink) for the full state to be re-published?"""
        if not self.enabled or self.sink is None:
            return False
        ask = getattr(self.sink, "snapshot_requested", None)
        return bool(ask is not None and ask())

    @property
    def pending(self) -> int:
        return len(self._pending)

    # -- sending -------------------------------------------------------------------------------
    def flush(self, now: float) -> int:
        """Send buffered events as one batch; if none and the sink has been idle for the
        heartbeat interval, send an empty batch. Returns the number of events sent."""
        if not self.enabled or self.sink is None:
            self._pending.clear()
            return 0
        if self._pending:
            pending, self._pending = self._pending, []
            enc, pack = self._encoded, self._pack
            events = [e.event(enc, pack) if type(e) is _Store else e for e in pending]
            self.sink.emit(events, self.dp_rank)
            self._last_sent = now
            self.events_emitted += len(events)
            self.batches_sent += 1
            return len(events)
        if self._last_sent is None or now - self._last_sent >= self.heartbeat_interval_s:
            self.sink.heartbeat(self.dp_rank)
            self._last_sent = now
            self.heartbeats_sent += 1
        return 0

    def close(self, now: float) -> None:
        self.flush(now)
        if self.sink is not None:
            self.sink.close()
