"""KV events read from NATS JetStream, with the interface of `indexer.subscriber.Subscriber`
(docs/jetstream.md, docs/CONTRACTS.md), so the ingest loop takes it by changing only its factory.

- A worker is added with `endpoint = "jetstream:<subject>"` (`schemas.jetstream.jetstream_endpoint`).
  Each worker gets its own ordered consumer (ephemeral, server-side filtered on its subject)
  starting right after its watermark.
- The watermark (`Batch.seq`, `watermark()`, `add(last_seq=...)`) is the JetStream **stream
  sequence** of the last message delivered: identical on every replica and exact across restarts.
- What happened between two messages is decided by `indexer.jetstream_sequencing` from the
  publisher's `Kvatlas-Epoch` / `Kvatlas-Seq` headers: a new epoch is a `Restart`; a hole that the
  stream cannot fill (lost before storage, or removed by retention) is `Gap(recovered=False)`, so
  the ingest clears the worker and asks for a snapshot.
- `request_snapshot` publishes on the worker's control subject (core NATS); a kvatlas producer on
  JetStream, or the relay in front of one on ZeroMQ, answers in-stream.

nats-py runs on a private loop thread; its callbacks only append to a queue that `poll` drains on
the caller's thread, where all sequencing happens. Not thread-safe (one consumer thread).

Memory is bounded at both hand-overs: the queue holds at most `max_queue` messages (a callback
that finds it full waits on the loop for `poll` to make room: backpressure, counted in
`stats.queue_full_waits`), and each NATS subscription buffers at most `sub_pending_msgs`. When that
buffer overflows nats-py drops a message (a slow consumer); the consumer is then restarted at the
worker's watermark, so the drop costs a re-read, never an event (`stats.slow_consumer_restarts`).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import queue
import time
from typing import Any

import msgspec
from nats.errors import SlowConsumerError
from nats.js import api
from nats.js.errors import NotFoundError

from indexer.jetstream_sequencing import StepKind, StreamCursor
from transport.natsio import NatsThread, ensure_stream
from indexer.deliveries import Batch, Delivery, Gap, Restart
from schemas.codec import DEFAULT_MAX_PAYLOAD as MAX_BATCH_BYTES
from schemas.jetstream import StreamSettings, control_subject, endpoint_subject, parse_headers, split_subject

log = logging.getLogger(__name__)


class JetStreamSubscriberStats(msgspec.Struct):
    received: int = 0
    bad_frames: int = 0  # messages without valid kvatlas headers (skipped, logged)
    duplicates: int = 0
    gaps: int = 0
    gaps_unrecovered: int = 0
    restarts: int = 0
    replay_batches: int = 0  # messages that were already in the stream when the worker was added
    snapshot_requests: int = 0
    subscribe_errors: int = 0
    queue_full_waits: int = 0  # a callback found the in-process queue full and waited (backpressure)
    slow_consumer_restarts: int = 0  # nats-py dropped a message; the consumer restarted at the watermark
    split_batches: int = 0  # batches stored as parts (schemas/jetstream.py) and put back together
    parts_dropped: int = 0  # parts whose run was broken (its start trimmed, or over the size cap)


class _Worker:
    __slots__ = ("worker_id", "subject", "cursor", "sub", "catchup_until", "pending", "stale", "gen", "parts")

    def __init__(self, worker_id: str, subject: str, cursor: StreamCursor) -> None:
        self.worker_id = worker_id
        self.subject = subject
        self.cursor = cursor
        self.sub: Any = None
        self.catchup_until = 0  # stream last_seq when added: messages up to it are catch-up
        self.pending = 0  # messages the server still holds for this consumer (consumer lag)
        self.stale = False
        self.gen = 0  # this worker's consumer generation: messages of a replaced consumer are ignored
        self.parts: _Parts | None = None  # a split batch being put back together


class _Parts:
    """The parts read so far of one batch stored as several messages."""

    __slots__ = ("epoch", "seq", "n", "chunks", "size")

    def __init__(self, epoch: str, seq: int, n: int) -> None:
        self.epoch = epoch
        self.seq = seq
        self.n = n
        self.chunks: list[bytes] = []
        self.size = 0


def _reply_positions(reply: str) -> tuple[int, int] | None:
    """(stream seq, pending) from a JetStream delivery's reply subject (v1 and v2 layouts)."""
    t = reply.split(".")
    try:
        if len(t) == 9:
            return int(t[5]), int(t[8])
        if len(t) in (11, 12):
            return int(t[7]), int(t[10])
    except ValueError:
        return None
    return None


class JetStreamSubscriber:
    """Same interface as `indexer.subscriber.Subscriber`, reading from one JetStream stream."""

    __slots__ = ("_nats", "_own_nats", "settings", "_workers", "_q", "_max_per_poll", "stats", "_closed",
                 "shared", "_by_subject", "_shared_sub", "_shared_from", "_dirty", "_shared_pending", "_gen",
                 "max_queue", "sub_pending_msgs", "_space", "_waiting", "_slow", "_listener", "_drop_at", "_shared_taken")

    def __init__(
        self,
        nats: str | NatsThread,
        *,
        stream: StreamSettings | None = None,
        ensure: bool = True,
        max_per_poll: int = 10_000,
        shared: bool = False,
        max_queue: int = 50_000,
        sub_pending_msgs: int = 65_536,
    ) -> None:
        """`nats`: a URL (own connection) or a shared `NatsThread`. `ensure`: create the stream
        when missing (never changes an existing one's limits). `shared`: one ordered consumer on
        the whole prefix for every worker (started at the lowest watermark; each worker skips what
        it already has) instead of one per worker — O(1) server consumers per replica, for
        fleets of thousands of workers (docs/scaling.md). `max_queue` / `sub_pending_msgs`: the
        in-process bounds (module docstring)."""
        if max_queue < 1 or sub_pending_msgs < 1:
            raise ValueError("max_queue and sub_pending_msgs must be >= 1")
        self.settings = stream or StreamSettings()
        self._own_nats = isinstance(nats, str)
        self._nats = NatsThread(nats, name="kvatlas-js-sub") if isinstance(nats, str) else nats
        self._workers: dict[str, _Worker] = {}
        self.max_queue = max_queue
        self.sub_pending_msgs = sub_pending_msgs
        self._q: queue.Queue[tuple[_Worker | None, Any, int]] = queue.Queue(max_queue)
        self._space = asyncio.Event()  # set on the loop when `poll` made room
        self._waiting = False  # a callback waits for room
        self._slow: queue.SimpleQueue[tuple[Any, int]] = queue.SimpleQueue()  # (subscription, dropped sseq)
        self._drop_at: dict[int, int] = {}  # id(subscription) -> first stream seq nats-py dropped
        self._shared_taken: int | None = None  # last stream seq the current shared consumer handed over
        self._max_per_poll = max_per_poll
        self.stats = JetStreamSubscriberStats()
        self._closed = False
        self.shared = shared
        self._by_subject: dict[str, _Worker] = {}
        self._shared_sub: Any = None
        self._shared_from: int | None = None  # stream seq the shared consumer started at
        self._dirty = False
        self._shared_pending = 0
        self._gen = 0  # shared consumer generation: messages of a replaced consumer are ignored
        self._listener = self._on_nats_error
        self._nats.error_listeners.append(self._listener)
        if ensure:
            try:
                self._nats.call(lambda: ensure_stream(self._js, self.settings, update=False))
            except Exception:
                self._nats.error_listeners.remove(self._listener)
                if self._own_nats:
                    self._nats.close()
                raise

    def _on_nats_error(self, exc: Exception) -> None:
        """On the loop: remember which subscription nats-py dropped a message from."""
        if isinstance(exc, SlowConsumerError):
            pos = _reply_positions(exc.reply or "")
            self._slow.put((exc.sub, 0 if pos is None else pos[0]))

    async def _enqueue(self, item: tuple[_Worker | None, Any, int]) -> None:
        """On the loop: put, or wait until `poll` made room (this subscription stops meanwhile)."""
        q = self._q
        while True:
            try:
                q.put_nowait(item)
                return
            except queue.Full:
                pass
            # Announce the wait before re-checking, so a drain in between is never missed.
            self._waiting = True
            self._space.clear()
            if not q.full():
                continue
            self.stats.queue_full_waits += 1
            await self._space.wait()

    @property
    def max_per_poll(self) -> int:
        """The most messages one `poll` takes: a poll that returns fewer has drained the queue."""
        return self._max_per_poll

    def frame_drops(self) -> dict[str, int]:
        """Nothing is dropped below the event layer here (bad headers are `stats.bad_frames`)."""
        return {}

    @property
    def queued(self) -> int:
        """Messages received from NATS and not yet taken by `poll` (at most `max_queue`)."""
        return self._q.qsize()

    @property
    def _js(self):  # noqa: ANN202 - touched on the loop only
        assert self._nats.js is not None
        return self._nats.js

    # --- membership -----------------------------------------------------------------------------

    def add(self, worker_id: str, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
            last_seq: int | None = None) -> None:
        """Start reading `endpoint` (`jetstream:<subject>`) after stream seq `last_seq` (None: from
        the first message the stream still holds). `replay_endpoint`/`topic` are unused (the
        stream is the replay); accepted for interface parity."""
        if self._closed:
            raise RuntimeError("subscriber is closed")
        if worker_id in self._workers:
            raise ValueError(f"worker {worker_id!r} is already subscribed")
        subject = endpoint_subject(endpoint)
        owner = next((o for o in self._workers.values() if o.subject == subject), None)
        if owner is not None:  # one subject, one worker: never re-route another worker's events
            raise ValueError(f"cannot subscribe worker {worker_id!r}: subject {subject!r} is worker "
                             f"{owner.worker_id!r}'s")
        cursor = StreamCursor(last_seq)  # validates last_seq
        w = _Worker(worker_id, subject, cursor)
        try:
            self._nats.call(lambda: self._start(w), timeout=15.0)
        except Exception as exc:
            self.stats.subscribe_errors += 1
            raise ValueError(f"cannot subscribe worker {worker_id!r} to {subject!r}: {exc!r}") from exc
        self._workers[worker_id] = w
        if self.shared:
            # The consumer may already be past this worker's start: restart it at the lowest start
            # (by the next poll, once for many adds); other workers skip what they already have.
            self._by_subject[subject] = w
            self._dirty = True

    async def _start(self, w: _Worker) -> None:
        js = self._js
        name = self.settings.name
        info = await js.stream_info(name)
        w.catchup_until = info.state.last_seq
        last = w.cursor.last
        config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL)
        if last is not None:
            try:
                prev = await js.get_msg(name, seq=last, direct=True)
            except NotFoundError:
                prev = None
            hdrs = parse_headers(prev.headers) if prev is not None and prev.subject == w.subject else None
            if hdrs is not None and not isinstance(hdrs, str):
                w.cursor.epoch, w.cursor.pubseq = hdrs.epoch, hdrs.seq
            else:
                # The watermark's message is gone: anything of ours after it may be gone too.
                w.cursor.maybe_trimmed = info.state.first_seq > last + 1
            config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                                        opt_start_seq=last + 1)
        if self.shared:
            return
        enqueue = self._enqueue
        gen = w.gen

        async def on_msg(msg: Any) -> None:
            await enqueue((w, msg, gen))

        w.sub = await js.subscribe(w.subject, stream=name, cb=on_msg, ordered_consumer=True, config=config,
                                   idle_heartbeat=2.0, pending_msgs_limit=self.sub_pending_msgs)

    def remove(self, worker_id: str) -> None:
        w = self._workers.pop(worker_id, None)
        if w is None:
            raise KeyError(f"unknown worker {worker_id!r}")
        if self._by_subject.get(w.subject) is w:
            del self._by_subject[w.subject]
        if w.sub is not None:
            self._drop_at.pop(id(w.sub._sub), None)
        self._unsubscribe(w)

    def _restart_shared(self, start: int | None = None) -> None:
        """(Re)start the one consumer at `start`, by default the lowest position any worker needs."""
        self._dirty = False
        starts = [1 if w.cursor.last is None else w.cursor.last + 1 for w in self._workers.values()]
        if not starts:
            return
        if start is None:
            start = min(starts)
        self._shared_taken = None
        old = self._shared_sub
        enqueue = self._enqueue
        by_subject = self._by_subject
        # Queued messages of the old consumer lie past the new start and will be delivered again.
        self._gen += 1
        gen = self._gen

        async def go() -> Any:
            if old is not None:
                await old.unsubscribe()
            async def on_msg(msg: Any) -> None:
                # Unregistered subjects still go through: they carry the consumer's backlog count.
                await enqueue((by_subject.get(msg.subject), msg, gen))

            config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
            return await self._js.subscribe(self.settings.prefix + ".>", stream=self.settings.name, cb=on_msg,
                                            ordered_consumer=True, config=config, idle_heartbeat=2.0,
                                            pending_msgs_limit=self.sub_pending_msgs)

        self._shared_sub = self._nats.call(go, timeout=15.0)
        self._shared_from = start

    def _restart_dropped(self, w: _Worker | None = None) -> None:
        """Restart consumers nats-py dropped a message from (all, or only `w`'s) right after the
        watermark. Called once everything before the drop was taken (a later message showed up,
        or the queue ran dry), so each restart makes progress; what the old consumer still had
        queued is ignored (new generation), so nothing is lost or applied twice."""
        self._collect_drops()
        if not self._drop_at:
            return
        if self.shared:
            self._drop_at.clear()  # only the current consumer's drops matter; it is replaced
            self.stats.slow_consumer_restarts += 1
            # Everything it delivered up to `taken` was handled: going back to the lowest watermark
            # would refill the same buffer with the same messages and never pass the drop.
            taken = self._shared_taken
            log.warning("shared consumer dropped messages (slow consumer): restarting after stream seq %s", taken)
            self._restart_shared(None if taken is None or self._dirty else taken + 1)
            return
        for x in ([w] if w is not None else list(self._workers.values())):
            if x.sub is None or self._drop_at.pop(id(x.sub._sub), None) is None:
                continue
            self.stats.slow_consumer_restarts += 1
            log.warning("worker %s: consumer dropped messages (slow consumer): restarting after stream seq %s",
                        x.worker_id, x.cursor.last)
            self._unsubscribe(x)
            x.sub = None
            x.gen += 1
            try:
                self._nats.call(functools.partial(self._start, x), timeout=15.0)
            except Exception as exc:
                self.stats.subscribe_errors += 1
                log.error("worker %s: cannot restart its consumer: %r", x.worker_id, exc)
        if not self._workers:
            self._drop_at.clear()

    def _collect_drops(self) -> None:
        while True:
            try:
                sub, sseq = self._slow.get_nowait()
            except queue.Empty:
                return
            key = id(sub)
            self._drop_at[key] = min(sseq, self._drop_at.get(key, sseq))

    def _past_drop(self, w: _Worker, msg: Any) -> bool:
        """The message came after one nats-py dropped on its subscription: applying it would skip
        the dropped one; the restart re-reads both."""
        sub = self._shared_sub if self.shared else w.sub
        at = None if sub is None else self._drop_at.get(id(sub._sub))
        if at is None:
            return False
        pos = _reply_positions(msg.reply or "")
        return pos is None or pos[0] >= at

    def _unsubscribe(self, w: _Worker) -> None:
        sub = w.sub
        if sub is None:
            return
        try:
            self._nats.call(sub.unsubscribe, timeout=5.0)
        except Exception as exc:  # the server drops an idle ephemeral consumer on its own
            log.warning("worker %s: unsubscribe failed: %r", w.worker_id, exc)

    def workers(self) -> list[str]:
        return list(self._workers)

    def watermark(self, worker_id: str) -> int | None:
        """Stream seq of the last message delivered for this worker (what a snapshot stores)."""
        return self._workers[worker_id].cursor.last

    def stream_state(self) -> dict[str, int]:
        """The stream's messages, bytes, first and last sequence, and consumer count (metrics)."""
        info = self._nats.call(lambda: self._js.stream_info(self.settings.name))
        st = info.state
        return {"messages": int(st.messages), "bytes": int(st.bytes), "first_seq": int(st.first_seq),
                "last_seq": int(st.last_seq), "consumers": int(st.consumer_count)}

    def consumer_lag(self) -> dict[str, int]:
        """Messages the server still holds for each worker's consumer, as of its last delivery
        (shared mode: the one consumer's backlog, for every worker)."""
        if self.shared:
            return {wid: self._shared_pending for wid in self._workers}
        return {wid: w.pending for wid, w in self._workers.items()}

    def request_snapshot(self, worker_id: str) -> bool:
        """Ask the worker's publisher (or the relay in front of it) to re-publish its state
        in-stream. Fire and forget; False when the request could not be sent."""
        w = self._workers.get(worker_id)
        if w is None:
            return False
        try:
            model, worker = split_subject(w.subject, self.settings.prefix)
            subject = control_subject(model, worker)
        except ValueError as exc:
            log.warning("worker %s: cannot derive a control subject: %s", worker_id, exc)
            return False

        async def send() -> None:
            nc = self._nats.nc
            assert nc is not None
            await nc.publish(subject, b"")
            await nc.flush(timeout=2)

        try:
            self._nats.call(send, timeout=3.0)
        except Exception as exc:
            log.warning("worker %s: snapshot request failed: %r", worker_id, exc)
            return False
        self.stats.snapshot_requests += 1
        log.info("worker %s: asked for a state snapshot on %s", worker_id, subject)
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in list(self._workers.values()):
            self._unsubscribe(w)
        if self._shared_sub is not None:
            try:
                self._nats.call(self._shared_sub.unsubscribe, timeout=5.0)
            except Exception as exc:
                log.warning("shared consumer unsubscribe failed: %r", exc)
        self._workers.clear()
        try:
            self._nats.error_listeners.remove(self._listener)
        except ValueError:
            pass
        if self._own_nats:
            self._nats.close()

    def __enter__(self) -> JetStreamSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- receiving ------------------------------------------------------------------------------

    def poll(self, timeout_ms: int) -> list[Delivery]:
        """Wait up to `timeout_ms` for a message, then take what is queued (bounded per call)."""
        out: list[Delivery] = []
        if self._closed:
            return out
        if self._dirty:
            self._restart_shared()
        q = self._q
        try:
            item = q.get(timeout=timeout_ms / 1000.0) if timeout_ms > 0 else q.get_nowait()
        except queue.Empty:
            self._restart_dropped()  # ran dry: everything before a drop was taken
            return out
        finally:
            self._wake()
        now = time.time()
        workers = self._workers
        n = 0
        while True:
            w, msg, gen = item
            if w is None:  # shared mode: a worker nobody registered here
                if gen == self._gen:
                    pos = _reply_positions(msg.reply or "")
                    if pos is not None:
                        if not self._slow.empty():
                            self._collect_drops()
                        sub = self._shared_sub
                        at = None if sub is None else self._drop_at.get(id(sub._sub))
                        if at is not None and pos[0] >= at:
                            self._restart_dropped()
                        else:
                            self._shared_pending = pos[1]
                            self._shared_taken = pos[0]
            # else: removed while its messages were queued, or from a replaced shared consumer
            elif gen == (self._gen if self.shared else w.gen) and workers.get(w.worker_id) is w:
                if not self._slow.empty():
                    self._collect_drops()
                if not self._drop_at or not self._past_drop(w, msg):
                    self._take(w, msg, now, out)
                else:  # everything before the drop was taken: re-read from here
                    self._restart_dropped(None if self.shared else w)
            n += 1
            if n >= self._max_per_poll:
                break
            try:
                item = q.get_nowait()
            except queue.Empty:
                break
        self.stats.received += n
        self._wake()
        return out

    def _wake(self) -> None:
        """Room was made: let a callback waiting for it go on (on the loop)."""
        if self._waiting:
            self._waiting = False
            self._nats.call_soon(self._space.set)

    def _take(self, w: _Worker, msg: Any, now: float, out: list[Delivery]) -> None:
        pos = _reply_positions(msg.reply or "")
        if pos is None:
            self._bad(w, f"no JetStream metadata in reply subject {msg.reply!r}")
            return
        sseq, w.pending = pos
        self._shared_pending = w.pending
        self._shared_taken = sseq
        hdrs = parse_headers(msg.headers)
        if isinstance(hdrs, str):
            w.cursor.skip(sseq)
            self._bad(w, f"stream seq {sseq}: {hdrs}")
            return
        data = msg.data
        if hdrs.parts > 1:
            data = self._join_part(w, sseq, hdrs, data)
            if data is None:
                return
        old = w.cursor.last
        steps = w.cursor.take(sseq, hdrs.epoch, hdrs.seq)
        if steps is None:
            self.stats.duplicates += 1
            return
        wid = w.worker_id
        for step in steps:
            if step.kind is StepKind.RESTART:
                self.stats.restarts += 1
                log.warning("worker %s: new publisher epoch %s at stream seq %d: publisher restarted",
                            wid, hdrs.epoch, sseq)
                out.append(Restart(wid, step.a, step.b))
            else:
                self.stats.gaps += 1
                self.stats.gaps_unrecovered += 1
                log.warning("worker %s: batches lost before stream seq %d (after %s, publisher seq %d); "
                            "resync needed", wid, sseq, old, hdrs.seq)
                out.append(Gap(wid, step.a, step.b, False))
        replayed = sseq <= w.catchup_until
        if replayed:
            self.stats.replay_batches += 1
        out.append(Batch(wid, sseq, data, now, replayed))

    def _join_part(self, w: _Worker, sseq: int, hdrs: Any, data: bytes) -> bytes | None:
        """Add a part of a split batch; the whole payload once its last part is read, else None.
        The watermark stays before the batch until then, so a restart re-reads it from part 0."""
        if w.cursor.last is not None and sseq <= w.cursor.last:
            return None  # re-delivered below the watermark
        p = w.parts
        if hdrs.part == 0:
            p = w.parts = _Parts(hdrs.epoch, hdrs.seq, hdrs.parts)
        elif p is None or (p.epoch, p.seq, p.n, len(p.chunks)) != (hdrs.epoch, hdrs.seq, hdrs.parts, hdrs.part):
            # its first parts were trimmed, or not consumed here: what the batch held is lost (the
            # next whole batch reads as a gap and the worker is resynced)
            w.parts = None
            self.stats.parts_dropped += 1
            return None
        p.chunks.append(data)
        p.size += len(data)
        if p.size > MAX_BATCH_BYTES:
            w.parts = None
            self.stats.parts_dropped += 1
            log.warning("worker %s: split batch seq %d exceeds %d bytes: dropped", w.worker_id, hdrs.seq,
                        MAX_BATCH_BYTES)
            return None
        if len(p.chunks) < p.n:
            return None
        w.parts = None
        self.stats.split_batches += 1
        return b"".join(p.chunks)

    def _bad(self, w: _Worker, why: str) -> None:
        self.stats.bad_frames += 1
        n = self.stats.bad_frames
        if n & (n - 1) == 0:
            log.warning("worker %s: dropped a message that is not a kvatlas batch (%d so far): %s",
                        w.worker_id, n, why)
