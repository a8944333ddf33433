"""The one event recorder every producer cache class uses (design §3).

It turns tier changes into SGLang-compatible KV events, coalesces consecutive pages into one
event, and hands whole batches to a sink at `flush`. Heartbeats (empty batches) go out when a
flush finds nothing to send and the sink has been idle for `heartbeat_interval_s`. No I/O of its
own and no clock: the caller passes `now`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

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
    def emit(self, events: list[KVEvent], dp_rank: int | None) -> None: ...
    def heartbeat(self, dp_rank: int | None) -> None: ...
    def snapshot_requested(self) -> bool: ...
    def close(self) -> None: ...


class EventRecorder:
    """Buffers events between flushes. `enabled=False` makes every call a no-op (and lets the
    cache skip hashing); a recorder without a sink just drops what it would send."""

    __slots__ = ("sink", "enabled", "dp_rank", "names", "heartbeat_interval_s",
                 "_pending", "_last_sent", "events_emitted", "batches_sent", "heartbeats_sent")

    def __init__(self, sink: EventSink | None = None, *, enabled: bool = True, dp_rank: int | None = None,
                 media_names: Mapping[Medium, str] = SGLANG_MEDIA, heartbeat_interval_s: float = 1.0) -> None:
        missing = [m.name for m in Medium if m not in media_names]
        if missing:
            raise ValueError(f"media_names lacks a wire name for {missing}")
        self.sink = sink
        self.enabled = enabled
        self.dp_rank = dp_rank
        self.names = dict(media_names)
        self.heartbeat_interval_s = heartbeat_interval_s
        self._pending: list[KVEvent] = []
        self._last_sent: float | None = None
        self.events_emitted = 0
        self.batches_sent = 0
        self.heartbeats_sent = 0

    # -- recording -----------------------------------------------------------------------------
    def stored(self, ids: Sequence[int], parent_id: int | None, tokens: Sequence[int], block_size: int,
               medium: Medium, *, group_idx: int | None = None, kind: str | None = None,
               window: int | None = None) -> None:
        """`group_idx` / `kind` / `window` are vLLM's KV-cache-group fields (docs/hybrid.md); left
        None they are omitted on the wire (SGLang's shape)."""
        if not self.enabled or not ids:
            return
        name = self.names[medium]
        pending = self._pending
        if pending:
            last = pending[-1]
            # Coalesce: the same tier and group continuing the chain the previous store ended.
            if (type(last) is BlockStored and last.medium == name and last.block_size == block_size
                    and parent_id is not None and last.block_hashes[-1] == parent_id
                    and last.group_idx == group_idx and last.kv_cache_spec_kind == kind):
                last.block_hashes.extend(ids)
                last.token_ids.extend(tokens)
                return
        if group_idx is None and kind is None and window is None:
            pending.append(BlockStored(list(ids), parent_id, list(tokens), block_size, None, name))
        else:
            pending.append(BlockStored(list(ids), parent_id, list(tokens), block_size, None, name,
                                       group_idx=group_idx, kv_cache_spec_kind=kind,
                                       kv_cache_spec_sliding_window=window))

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
            events, self._pending = self._pending, []
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
