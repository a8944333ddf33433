"""ZeroMQ KV-event publisher, wire-compatible with vLLM / SGLang subscribers (design §2).

- PUB socket, multipart `[topic, seq (8-byte BE unsigned), payload]`, seq from 0, +1 per batch,
  assigned by the publisher thread at send time.
- ROUTER replay socket: a DEALER sends `[b"", start_seq (8B BE)]`; we answer
  `[b"", topic, seq, payload]` for every buffered batch with seq >= start, then the end marker
  `[b"", b"", (-1 as 8-byte signed BE), b""]`. (vLLM 0.33 and SGLang 0.5.23 themselves omit the
  topic frame — `[b"", seq, payload]` / `[b"", END, b""]`; our subscriber accepts both.)
- All socket work happens on one background thread (ZMQ sockets are not thread-safe). Callers
  hand batches over through a bounded queue and wake the thread through a pipe, so the thread
  sleeps in `zmq.Poller` with no timeout instead of spinning.
- `close()` drains the queue, sends everything, then closes with a bounded linger on a private
  context: the tail is flushed to connected subscribers, and nothing waits for absent ones.

Importing this module does not import torch.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq

from schemas.events import KVEvent, KVEventBatch
from schemas.frames import END_SEQ, SEQ_BYTES, SNAPSHOT_REQUEST, seq_bytes, seq_of

log = logging.getLogger(__name__)

_CLOSE = object()  # queue sentinel


class PublisherStats(msgspec.Struct):
    published: int = 0
    blocked_puts: int = 0  # publish() found the queue full and had to wait
    send_errors: int = 0
    replay_requests: int = 0
    replay_batches: int = 0
    bad_replay_requests: int = 0
    snapshot_requests: int = 0


class ZmqEventPublisher:
    """Publishes KV event batches on a PUB socket and serves replays on a ROUTER socket."""

    __slots__ = (
        "_topic", "_buffer", "_queue", "_ctx", "_own_ctx", "_pub", "_replay", "_thread",
        "_wake_r", "_wake_w", "_closed", "_close_lock", "_next_seq", "_enqueued", "_sent",
        "_count_lock", "_sent_cond", "stats", "endpoint", "replay_endpoint", "_linger_ms",
        "_encoder", "_snapshots_taken",
    )

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        max_queue: int = 100_000,
        hwm: int = 100_000,
        ctx: zmq.Context | None = None,
        linger_ms: int = 2_000,
    ) -> None:
        if buffer_steps < 0 or max_queue < 1 or hwm < 0:
            raise ValueError("buffer_steps >= 0, max_queue >= 1 and hwm >= 0 are required")
        self._topic = topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue)
        self._own_ctx = ctx is None
        self._ctx = zmq.Context() if ctx is None else ctx
        self._linger_ms = linger_ms
        self._encoder = msgspec.msgpack.Encoder()
        self.stats = PublisherStats()
        self._snapshots_taken = 0
        self._next_seq = 0
        self._enqueued = 0
        self._sent = 0
        self._count_lock = threading.Lock()
        self._sent_cond = threading.Condition()
        self._closed = False
        self._close_lock = threading.Lock()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, linger_ms)
            self._pub.bind(endpoint)  # the publisher owns its endpoint; subscribers connect
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # A whole replay is sent in one go: the HWM must hold it, or ROUTER drops the tail.
                self._replay.setsockopt(zmq.SNDHWM, max(hwm, buffer_steps + 16))
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets(0)
            if self._own_ctx:
                self._ctx.term()
            raise ValueError(f"cannot bind publisher sockets ({endpoint}, {replay_endpoint}): {exc}") from exc
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="kvatlas-publisher", daemon=True)
        self._thread.start()

    # --- caller side ----------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        """The seq the next batch sent will carry."""
        return self._next_seq

    def publish(self, events: Sequence[KVEvent], dp_rank: int | None = None) -> None:
        """Queue one batch. Thread-safe; blocks (and counts it) only when the queue is full."""
        self._put(KVEventBatch(time.time(), list(events), dp_rank))

    def publish_payload(self, payload: bytes) -> None:
        """Queue one pre-encoded batch (sent byte for byte)."""
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
        self._put(bytes(payload))

    def heartbeat(self, dp_rank: int | None = None) -> None:
        """An empty batch: lets subscribers notice liveness and gaps while the cache is idle."""
        self.publish([], dp_rank)

    def snapshot_requested(self) -> bool:
        """True once per batch of snapshot requests received since the last call (the producer
        then publishes its state in-stream; see SNAPSHOT_REQUEST). Called by the cache's thread."""
        pending = self.stats.snapshot_requests  # written by the publisher thread only
        if pending == self._snapshots_taken:
            return False
        self._snapshots_taken = pending
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far has been handed to ZMQ. False on timeout."""
        with self._count_lock:
            target = self._enqueued
        with self._sent_cond:
            return self._sent_cond.wait_for(lambda: self._sent >= target or not self._thread.is_alive(),
                                            timeout) and self._sent >= target

    def close(self, timeout: float = 5.0) -> None:
        """Send everything queued, then close the sockets. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + timeout
        # Flush to connected subscribers, but never wait longer than the caller allowed.
        self._linger_ms = max(0, min(self._linger_ms, int(timeout * 1000)))
        try:
            self._queue.put(_CLOSE, timeout=max(0.0, timeout))
        except queue.Full:
            log.warning("publisher queue still full at close; %d batches dropped", self._queue.qsize())
        self._wake()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("publisher thread did not stop within %.1fs", timeout)
            return  # the thread owns the sockets; it closes them when it gets there
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self._own_ctx:
            # term() waits for the linger of unsent messages to connected peers, bounded.
            self._ctx.term()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _put(self, item: object) -> None:
        if self._closed:
            raise RuntimeError("publisher is closed")
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._count_lock:
                self.stats.blocked_puts += 1
            while True:
                try:
                    self._queue.put(item, timeout=0.5)
                    break
                except queue.Full:
                    if self._closed or not self._thread.is_alive():
                        raise RuntimeError("publisher closed while the queue was full") from None
        with self._count_lock:
            self._enqueued += 1
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # pipe full: the thread has plenty of wake-ups pending already
        except OSError:
            pass  # closed during shutdown

    # --- publisher thread -----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        stopping = False
        try:
            while not stopping:
                events = dict(poller.poll())
                if self._replay is not None and self._replay in events:
                    self._serve_replays()
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 65536):
                            pass
                    except BlockingIOError:
                        pass
                # Drain the queue completely: a wake-up byte is written after every put.
                sent = 0
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is _CLOSE:
                        stopping = True
                        continue  # keep draining anything queued before close() returned
                    self._send(item)
                    sent += 1
                    if sent % 256 == 0 and self._replay is not None and self._replay.poll(0):
                        self._serve_replays()  # don't starve replay clients under load
                if sent:
                    with self._sent_cond:
                        self._sent += sent
                        self._sent_cond.notify_all()
        except Exception:  # noqa: BLE001 - the thread must log, never die silently
            log.exception("publisher thread failed")
        finally:
            self._close_sockets(self._linger_ms)
            with self._sent_cond:
                self._sent_cond.notify_all()

    def _send(self, item: object) -> None:
        assert self._pub is not None
        try:
            payload = item if isinstance(item, bytes) else self._encoder.encode(item)
        except (TypeError, ValueError, OverflowError) as exc:
            self.stats.send_errors += 1
            log.error("cannot encode KV event batch (dropped, no seq used): %s", exc)
            return
        seq = self._next_seq
        try:
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload), copy=False)
        except zmq.ZMQError as exc:
            # The seq is consumed anyway, so subscribers see a gap and can replay it.
            self.stats.send_errors += 1
            log.error("PUB send failed for seq %d: %s", seq, exc)
        self._buffer.append((seq, payload))
        self._next_seq = seq + 1
        self.stats.published += 1

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if frames[-1] == SNAPSHOT_REQUEST and len(frames) in (2, 3):
                self.stats.snapshot_requests += 1
                log.info("snapshot requested by a subscriber: the next step publishes the full state")
                continue
            self.stats.replay_requests += 1
            # DEALER: [id, b"", start]; REQ-less clients may omit the delimiter: [id, start].
            if len(frames) == 3 and frames[1] == b"" and len(frames[2]) == SEQ_BYTES:
                ident, delim, start_b = frames[0], [b""], frames[2]
            elif len(frames) == 2 and len(frames[1]) == SEQ_BYTES:
                ident, delim, start_b = frames[0], [], frames[1]
            else:
                self.stats.bad_replay_requests += 1
                log.warning("invalid replay request (%d frames) ignored", len(frames))
                continue
            start = seq_of(start_b)
            n = 0
            try:
                for seq, payload in self._buffer:
                    if seq >= start:
                        self._replay.send_multipart(
                            [ident, *delim, self._topic, seq_bytes(seq), payload], copy=False)
                        n += 1
                self._replay.send_multipart([ident, *delim, b"", END_SEQ, b""])
            except zmq.ZMQError as exc:
                log.warning("replay to a client failed after %d batches: %s", n, exc)
            self.stats.replay_batches += n

    def _close_sockets(self, linger_ms: int) -> None:
        if self._pub is not None:
            self._pub.close(linger=linger_ms)
        if self._replay is not None:
            self._replay.close(linger=0)
