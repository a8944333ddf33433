"""KV-event batches to NATS JetStream, same payload bytes as on ZeroMQ (docs/jetstream.md).

Same shape as `producer.publisher.ZmqEventPublisher` — `publish`, `publish_payload`, `heartbeat`,
`next_seq`, `flush`, `close`, `snapshot_requested`, `stats` — so `producer.sinks.ZmqSink` drives it
unchanged (a `TeeSink` of both publishes to ZeroMQ *and* JetStream).

- Subject `kvatlas.events.<model>.<worker>`; headers `Kvatlas-Seq` (0, 1, 2, … per publisher),
  `Kvatlas-Epoch` (fresh per publisher: a restarted producer is a new epoch, which consumers read
  as a restart) and `Nats-Msg-Id` (JetStream drops a re-sent batch inside its duplicate window).
- nats-py is asyncio: the connection lives on a private loop thread (`transport.natsio`). Callers
  hand batches over through a bounded budget (blocks, and counts it, when `max_queue` are in
  flight); one pump on the loop publishes them in seq order with async acks.
- Snapshot requests arrive on core NATS (`kvatlas.control.snapshot.<model>.<worker>`); the cache
  sees them through `snapshot_requested()` exactly as with ZeroMQ.

Importing this module does not import torch.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgspec

from transport.natsio import NatsThread, ensure_stream
from schemas.jetstream import (
    HDR_EPOCH, HDR_MSG_ID, HDR_PART, HDR_SEQ, PART_HEADROOM, StreamSettings, control_subject, event_subject, msg_id,
    part_msg_id, subject_token,
)
from schemas.events import KVEvent, KVEventBatch

log = logging.getLogger(__name__)


class JetStreamPublisherStats(msgspec.Struct):
    published: int = 0  # handed to the connection
    acked: int = 0  # stored by JetStream
    duplicates: int = 0  # acked as a duplicate (already stored)
    send_errors: int = 0  # publish or ack failed: consumers will see a seq gap
    blocked_puts: int = 0
    snapshot_requests: int = 0
    split_batches: int = 0  # batches over the server's max_payload, stored as parts (schemas/jetstream.py)
    parts: int = 0  # messages those batches took


def new_epoch() -> str:
    """A fresh publisher incarnation id (16 hex digits)."""
    return secrets.token_hex(8)


class JetStreamEventPublisher:
    """Publishes one worker's batches to its JetStream subject."""

    __slots__ = ("subject", "model", "worker_id", "epoch", "stats", "_nats", "_own_nats", "_token",
                 "_encoder", "_lock", "_next_seq", "_pending", "_budget", "_enqueued", "_done",
                 "_done_cond", "_closed", "_wakeup", "_pump", "_snapshots_taken", "_ctl_sub", "stream")

    def __init__(
        self,
        nats: str | NatsThread,
        *,
        model: str,
        worker_id: str,
        stream: StreamSettings | None = None,
        ensure: bool = True,
        epoch: str | None = None,
        first_seq: int = 0,
        max_queue: int = 100_000,
        listen_snapshots: bool = True,
    ) -> None:
        """`nats`: a URL (own connection) or a shared `NatsThread`. `ensure`: create/update the
        stream. `epoch`/`first_seq`: continue an earlier incarnation (the relay does); default is
        a new epoch from seq 0."""
        if max_queue < 1 or first_seq < 0:
            raise ValueError("max_queue >= 1 and first_seq >= 0 are required")
        self.stream = stream or StreamSettings()
        self.model = model
        self.worker_id = worker_id
        self.subject = event_subject(model, worker_id, self.stream.prefix)
        self._token = subject_token(worker_id)
        self.epoch = epoch or new_epoch()
        self.stats = JetStreamPublisherStats()
        self._own_nats = isinstance(nats, str)
        self._nats = NatsThread(nats, name=f"kvatlas-js-pub-{worker_id}") if isinstance(nats, str) else nats
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()  # seq assignment and queue order
        self._next_seq = first_seq
        self._pending: deque[tuple[int, str, bytes]] = deque()
        self._budget = threading.BoundedSemaphore(max_queue)
        self._enqueued = 0
        self._done = 0  # acked or failed
        self._done_cond = threading.Condition()
        self._closed = False
        self._snapshots_taken = 0
        self._ctl_sub = None
        try:
            if ensure:
                self._nats.call(lambda: ensure_stream(self._js, self.stream))
            self._wakeup: asyncio.Event = self._nats.call(self._make_event)
            self._pump = self._nats.submit(self._run_pump)
            if listen_snapshots:
                self._ctl_sub = self._nats.call(self._listen)
        except Exception:
            if self._own_nats:
                self._nats.close()
            raise

    @property
    def _js(self):  # noqa: ANN202 - nats.js.JetStreamContext, touched on the loop only
        assert self._nats.js is not None
        return self._nats.js

    async def _make_event(self) -> asyncio.Event:
        return asyncio.Event()

    async def _listen(self):  # noqa: ANN202
        async def on_request(_msg) -> None:  # noqa: ANN001
            self.stats.snapshot_requests += 1
            log.info("worker %s: snapshot requested over NATS", self.worker_id)

        assert self._nats.nc is not None
        return await self._nats.nc.subscribe(control_subject(self.model, self.worker_id), cb=on_request)

    # --- caller side ----------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def publish(self, events: Sequence[KVEvent], dp_rank: int | None = None) -> None:
        self.publish_payload(self._encoder.encode(KVEventBatch(time.time(), list(events), dp_rank)))

    def heartbeat(self, dp_rank: int | None = None) -> None:
        self.publish([], dp_rank)

    def publish_payload(self, payload: bytes) -> None:
        """Queue one pre-encoded batch (sent byte for byte); blocks only when `max_queue` batches
        are still unacknowledged."""
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
        self._enqueue(None, bytes(payload))

    def publish_at(self, seq: int, payload: bytes) -> None:
        """Publish with an explicit seq (the relay forwards the engine's own seqs, so a batch the
        engine lost stays a hole that consumers see). `seq` must be >= `next_seq`."""
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
        self._enqueue(seq, bytes(payload))

    def new_epoch(self) -> str:
        """Start a new incarnation (the source restarted): later batches carry a fresh epoch,
        which consumers read as a restart, and seqs count from 0 again."""
        with self._lock:
            self.epoch = new_epoch()
            self._next_seq = 0
            return self.epoch

    def _enqueue(self, seq: int | None, payload: bytes) -> None:
        if self._closed:
            raise RuntimeError("publisher is closed")
        if not self._budget.acquire(blocking=False):
            self.stats.blocked_puts += 1
            while not self._budget.acquire(timeout=0.5):
                if self._closed:
                    raise RuntimeError("publisher closed while its queue was full")
        with self._lock:
            if seq is None:
                seq = self._next_seq
            elif seq < self._next_seq:
                self._budget.release()
                raise ValueError(f"seq {seq} is behind the next seq {self._next_seq} of epoch {self.epoch}")
            self._next_seq = seq + 1
            self._pending.append((seq, self.epoch, payload))
            self._enqueued += 1
        self._nats.call_soon(self._wakeup.set)

    def snapshot_requested(self) -> bool:
        """True once per batch of snapshot requests received since the last call."""
        pending = self.stats.snapshot_requests
        if pending == self._snapshots_taken:
            return False
        self._snapshots_taken = pending
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every batch queued so far is acknowledged (or failed). False on timeout."""
        with self._lock:
            target = self._enqueued
        with self._done_cond:
            return self._done_cond.wait_for(lambda: self._done >= target, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Publish what is queued (bounded by `timeout`), then stop. Idempotent."""
        if self._closed:
            return
        if not self.flush(timeout):
            log.warning("worker %s: %d batches unacknowledged at close", self.worker_id,
                        self._enqueued - self._done)
        self._closed = True
        self._pump.cancel()
        if self._ctl_sub is not None:
            sub = self._ctl_sub
            try:
                self._nats.call(sub.unsubscribe, timeout=timeout)
            except Exception as exc:
                log.debug("unsubscribe failed: %r", exc)
        if self._own_nats:
            self._nats.close(timeout)

    def __enter__(self) -> JetStreamEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- loop side ------------------------------------------------------------------------------

    def _finish(self, n: int = 1) -> None:
        for _ in range(n):
            self._budget.release()
        with self._done_cond:
            self._done += n
            self._done_cond.notify_all()

    async def _run_pump(self) -> None:
        js = self._js
        wake = self._wakeup
        subject = self.subject
        token = self._token
        while True:
            await wake.wait()
            wake.clear()
            while True:
                with self._lock:
                    if not self._pending:
                        break
                    seq, epoch, payload = self._pending.popleft()
                limit = self._part_limit()
                try:
                    if len(payload) > limit:
                        fut = await self._publish_parts(js, subject, token, seq, epoch, payload, limit)
                    else:
                        headers = {HDR_SEQ: str(seq), HDR_EPOCH: epoch, HDR_MSG_ID: msg_id(token, epoch, seq)}
                        fut = await js.publish_async(subject, payload, headers=headers)
                except Exception as exc:
                    self.stats.send_errors += 1
                    log.warning("worker %s: publish of seq %d failed: %r", self.worker_id, seq, exc)
                    self._finish()
                    continue
                self.stats.published += 1
                fut.add_done_callback(self._on_ack)

    def _part_limit(self) -> int:
        """Payload bytes one message may carry: the server's max_payload less header headroom."""
        nc = self._nats.nc
        max_payload = getattr(nc, "max_payload", 0) or 1024 * 1024
        return max(1024, int(max_payload) - PART_HEADROOM)

    async def _publish_parts(self, js, subject: str, token: str, seq: int, epoch: str,  # noqa: ANN001
                             payload: bytes, limit: int) -> asyncio.Future:
        """Store one oversized batch as consecutive parts (never a hole: consumers apply the batch
        when its last part arrives). Returns the last part's ack future; an earlier part's failure
        is counted as a send error."""
        view = memoryview(payload)
        n = -(-len(payload) // limit)
        self.stats.split_batches += 1
        self.stats.parts += n
        fut = None
        for i in range(n):
            headers = {HDR_SEQ: str(seq), HDR_EPOCH: epoch, HDR_PART: f"{i}/{n}",
                       HDR_MSG_ID: part_msg_id(token, epoch, seq, i)}
            fut = await js.publish_async(subject, bytes(view[i * limit:(i + 1) * limit]), headers=headers)
            if i < n - 1:
                fut.add_done_callback(self._on_part_ack)
        assert fut is not None
        return fut

    def _on_part_ack(self, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            self.stats.send_errors += 1
            log.warning("worker %s: JetStream did not store part of a split batch", self.worker_id)

    def _on_ack(self, fut: asyncio.Future) -> None:
        if fut.cancelled():
            self.stats.send_errors += 1
        else:
            exc = fut.exception()
            if exc is not None:
                self.stats.send_errors += 1
                log.warning("worker %s: JetStream did not store a batch: %r", self.worker_id, exc)
            else:
                self.stats.acked += 1
                if fut.result().duplicate:
                    self.stats.duplicates += 1
        self._finish()
