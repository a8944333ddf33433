"""Where the recorder's batches go: the ZMQ publisher, an event-log file, both, or a list (tests).

Each sink encodes a batch once with `schemas.codec.encode_batch`; a `TeeSink` shares that
payload so the log holds exactly the bytes that were published, with the same seq.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from schemas.codec import encode_batch
from schemas.events import KVEvent, KVEventBatch


class EventPublisher(Protocol):
    """What a ZmqSink drives: `producer.publisher.ZmqEventPublisher`, or
    `transport.jetstream_publisher.JetStreamEventPublisher` (same methods)."""

    @property
    def next_seq(self) -> int: ...
    def publish_payload(self, payload: bytes) -> None: ...
    def snapshot_requested(self) -> bool: ...
    def close(self) -> None: ...


class LogWriter(Protocol):
    """What an EventLogSink writes to: `indexer.eventlog.EventLogWriter` (not imported: the producer
    does not depend on the indexer)."""

    def write(self, recv_ts: float, worker: str, dp_rank: int | None, seq: int, payload: bytes) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class ListSink:
    """Keeps every batch in memory (tests, demos)."""

    __slots__ = ("batches", "heartbeats", "closed")
    encodes_events = False  # keeps the events themselves (producer.events.EventSink)
    asks_snapshots = False

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []
        self.heartbeats = 0
        self.closed = False

    def emit(self, events: list[KVEvent], dp_rank: int | None) -> None:
        self.batches.append(KVEventBatch(time.time(), events, dp_rank))

    def heartbeat(self, dp_rank: int | None) -> None:
        self.heartbeats += 1
        self.batches.append(KVEventBatch(time.time(), [], dp_rank))

    def snapshot_requested(self) -> bool:
        return False

    def events(self) -> list[KVEvent]:
        return [e for b in self.batches for e in b.events]

    def close(self) -> None:
        self.closed = True


class _PayloadSink:
    """Base for sinks that consume encoded payloads. They only send the bytes of a batch, so the
    recorder may encode it for them (`encodes_events`, producer.events.EventSink)."""

    __slots__ = ()
    encodes_events = True
    # snapshot_requested() here is always False, so the recorder need not poll it; a subclass
    # with its own snapshot_requested asks (set below, per subclass).
    asks_snapshots = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.asks_snapshots = cls.snapshot_requested is not _PayloadSink.snapshot_requested

    def send_payload(self, payload: bytes) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    # The batch timestamp: wall clock, as vLLM and SGLang stamp theirs (the clock itself, so a
    # flush pays no Python frame for it).
    batch_ts = staticmethod(time.time)

    def emit(self, events: list[KVEvent], dp_rank: int | None) -> None:
        self.send_payload(encode_batch(KVEventBatch(self.batch_ts(), events, dp_rank)))

    def heartbeat(self, dp_rank: int | None) -> None:
        self.emit([], dp_rank)

    def snapshot_requested(self) -> bool:
        """Has a consumer asked for the full state (ZMQ only)?"""
        return False


class ZmqSink(_PayloadSink):
    """Over `producer.publisher.ZmqEventPublisher`; the publisher assigns seq and serves replay."""

    __slots__ = ("publisher", "owns")

    def __init__(self, publisher: EventPublisher, owns: bool = True) -> None:
        self.publisher = publisher
        self.owns = owns

    def send_payload(self, payload: bytes) -> None:
        self.publisher.publish_payload(payload)

    def snapshot_requested(self) -> bool:
        return self.publisher.snapshot_requested()

    def close(self) -> None:
        if self.owns:
            self.publisher.close()


class EventLogSink(_PayloadSink):
    """Writes frames straight into an `indexer.eventlog.EventLogWriter` with its own seq counter
    (0, 1, 2, … like a publisher), so the log can be replayed as if it had been recorded live."""

    __slots__ = ("writer", "worker", "dp_rank", "seq", "owns", "clock")

    def __init__(self, writer: LogWriter, worker: str, dp_rank: int | None = None, start_seq: int = 0,
                 owns: bool = True, clock: Callable[[], float] = time.time) -> None:
        self.writer = writer
        self.worker = worker
        self.dp_rank = dp_rank
        self.seq = start_seq
        self.owns = owns
        self.clock = clock

    def send_payload(self, payload: bytes) -> None:
        self.writer.write(self.clock(), self.worker, self.dp_rank, self.seq, payload)
        self.seq += 1

    def close(self) -> None:
        if self.owns:
            self.writer.close()
        else:
            self.writer.flush()


class TeeSink(_PayloadSink):
    """Sends one encoded payload to several payload sinks (e.g. ZMQ and an event log)."""

    __slots__ = ("sinks",)

    def __init__(self, *sinks: _PayloadSink) -> None:
        if not sinks:
            raise ValueError("TeeSink needs at least one sink")
        self.sinks = sinks

    def send_payload(self, payload: bytes) -> None:
        for s in self.sinks:
            s.send_payload(payload)

    def snapshot_requested(self) -> bool:
        return any([s.snapshot_requested() for s in self.sinks])  # a list: consume every flag

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def make_sink(publisher: EventPublisher | None = None, log_writer: LogWriter | None = None,
              worker: str = "worker", dp_rank: int | None = None) -> _PayloadSink:
    """The ZMQ publisher, an event log, or both (sharing payload and seq)."""
    sinks: list[_PayloadSink] = []
    if publisher is not None:
        sinks.append(ZmqSink(publisher))
    if log_writer is not None:
        start = publisher.next_seq if publisher is not None else 0
        sinks.append(EventLogSink(log_writer, worker, dp_rank, start_seq=start))
    if not sinks:
        raise ValueError("make_sink needs a publisher, a log writer, or both")
    return sinks[0] if len(sinks) == 1 else TeeSink(*sinks)
