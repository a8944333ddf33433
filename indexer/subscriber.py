"""ZeroMQ KV-event subscriber: one SUB socket per publisher, gap recovery through the replay socket.

`poll()` returns deliveries in per-worker seq order:
- `Batch`   a payload to apply (`replayed=True` when it came from the replay socket),
- `Gap`     announced *before* the batches that follow it; `recovered=False` means some batches
            are lost and the consumer must resync the worker (clear it, rebuild from what follows),
- `Restart` the publisher started over at seq 0: clear the worker, then apply what follows.

Sequencing decisions are made by `indexer.sequencing` (pure); this module does the I/O.
Replies on the replay socket are accepted in both shapes found in the wild: 4 frames
`[b"", topic, seq, payload]` (design §2, TensorRT-LLM, our publisher) and 3 frames
`[b"", seq, payload]` (vLLM 0.33, SGLang 0.5.23 omit the topic), with the matching end markers.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Union

import msgspec
import zmq

from indexer.sequencing import DeliverStep, GapStep, SeqTracker, on_live
from schemas.frames import END_SEQ, SEQ_BYTES, SNAPSHOT_REQUEST, seq_bytes, seq_of

log = logging.getLogger(__name__)

_NOBLOCK = int(zmq.NOBLOCK)  # a plain int: the flag enum costs a conversion per recv


class Batch(msgspec.Struct, frozen=True):
    worker_id: str
    seq: int
    payload: bytes
    recv_ts: float
    replayed: bool = False


class Gap(msgspec.Struct, frozen=True):
    worker_id: str
    first: int
    last: int
    recovered: bool


class Restart(msgspec.Struct, frozen=True):
    worker_id: str
    old_seq: int
    new_seq: int


Delivery = Union[Batch, Gap, Restart]


class SubscriberStats(msgspec.Struct):
    received: int = 0
    bad_frames: int = 0
    duplicates: int = 0
    gaps: int = 0
    gaps_unrecovered: int = 0
    restarts: int = 0
    replay_requests: int = 0
    replay_timeouts: int = 0
    replay_batches: int = 0
    replay_extra: int = 0  # replayed batches outside the gap, left to the live stream
    replay_bad_frames: int = 0
    dropped_by_hook: int = 0
    snapshot_requests: int = 0


class _Source:
    __slots__ = ("worker_id", "endpoint", "replay_endpoint", "topic", "sock", "tracker")

    def __init__(self, worker_id: str, endpoint: str, replay_endpoint: str | None, topic: bytes,
                 sock: zmq.Socket, tracker: SeqTracker) -> None:
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.sock = sock
        self.tracker = tracker


def parse_replay_reply(frames: list[bytes]) -> tuple[int, bytes] | None | str:
    """One DEALER-side replay reply -> `(seq, payload)`, `None` for the end marker, or a str
    describing why the frames are malformed."""
    if len(frames) == 4 and frames[0] == b"":
        seq_b, payload = frames[2], frames[3]
    elif len(frames) == 3 and frames[0] == b"":
        seq_b, payload = frames[1], frames[2]
    else:
        return f"unexpected replay reply shape ({len(frames)} frames)"
    if seq_b == END_SEQ:
        return None
    if len(seq_b) != SEQ_BYTES:
        return f"replay seq frame of {len(seq_b)} bytes"
    return seq_of(seq_b), payload


class Subscriber:
    """Connects to one or many publishers; not thread-safe (one consumer thread calls poll)."""

    __slots__ = ("_ctx", "_own_ctx", "_sources", "_by_sock", "_poller", "replay_timeout",
                 "_drop_live", "_max_per_poll", "_rcvhwm", "stats", "_closed")

    def __init__(
        self,
        ctx: zmq.Context | None = None,
        replay_timeout: float = 2.0,
        *,
        drop_live: Callable[[str, int], bool] | None = None,
        max_per_poll: int = 10_000,
        rcvhwm: int = 1_000_000,
    ) -> None:
        """`replay_timeout`: seconds of silence on the replay socket before giving up.
        `drop_live(worker_id, seq)`: test hook — live batches it returns True for are discarded as
        if lost on the wire (counted in `stats.dropped_by_hook`)."""
        self._own_ctx = ctx is None
        self._ctx = zmq.Context() if ctx is None else ctx
        self._sources: dict[str, _Source] = {}
        self._by_sock: dict[zmq.Socket, _Source] = {}
        self._poller = zmq.Poller()
        self.replay_timeout = replay_timeout
        self._drop_live = drop_live
        self._max_per_poll = max_per_poll
        self._rcvhwm = rcvhwm
        self.stats = SubscriberStats()
        self._closed = False

    # --- membership -----------------------------------------------------------------------------

    def add(self, worker_id: str, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
            last_seq: int | None = None) -> None:
        """Subscribe to a publisher. `last_seq` is the watermark already applied (None: nothing);
        the first message triggers a replay of whatever lies between it and the watermark."""
        if self._closed:
            raise RuntimeError("subscriber is closed")
        if worker_id in self._sources:
            raise ValueError(f"worker {worker_id!r} is already subscribed")
        tracker = SeqTracker(last_seq)  # validates last_seq
        sock = self._ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
            sock.setsockopt(zmq.RECONNECT_IVL, 50)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ValueError(f"cannot connect to {endpoint!r} for worker {worker_id!r}: {exc}") from exc
        src = _Source(worker_id, endpoint, replay_endpoint, topic.encode("utf-8"), sock, tracker)
        self._sources[worker_id] = src
        self._by_sock[sock] = src
        self._poller.register(sock, zmq.POLLIN)

    def remove(self, worker_id: str) -> None:
        src = self._sources.pop(worker_id, None)
        if src is None:
            raise KeyError(f"unknown worker {worker_id!r}")
        self._poller.unregister(src.sock)
        del self._by_sock[src.sock]
        src.sock.close(linger=0)

    def workers(self) -> list[str]:
        return list(self._sources)

    def request_snapshot(self, worker_id: str) -> bool:
        """Ask the worker's publisher to re-publish its whole state in-stream (fire and forget:
        the answer is an ordinary batch that starts with AllBlocksCleared). False when the worker
        has no replay endpoint to ask."""
        src = self._sources.get(worker_id)
        if src is None or src.replay_endpoint is None:
            return False
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(src.replay_endpoint)
            sock.send_multipart([b"", SNAPSHOT_REQUEST], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("worker %s: snapshot request to %s failed: %s", worker_id, src.replay_endpoint, exc)
            sock.close(linger=0)
            return False
        sock.close(linger=2000)  # delivered once connected; close() itself does not wait
        self.stats.snapshot_requests += 1
        log.info("worker %s: asked %s for a state snapshot", worker_id, src.replay_endpoint)
        return True

    def watermark(self, worker_id: str) -> int | None:
        """Last seq delivered for this worker (what a snapshot should store)."""
        return self._sources[worker_id].tracker.last

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for wid in list(self._sources):
            self.remove(wid)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- receiving ------------------------------------------------------------------------------

    def poll(self, timeout_ms: int) -> list[Delivery]:
        """Wait up to `timeout_ms` for messages, then drain what is ready (bounded per call)."""
        out: list[Delivery] = []
        if self._closed or not self._sources:
            return out
        ready = self._poller.poll(timeout_ms)
        budget = self._max_per_poll
        by_sock = self._by_sock
        while ready and budget > 0:
            for sock, _ in ready:
                src = by_sock.get(sock)
                if src is None:
                    continue
                # A bounded chunk per socket so one busy publisher cannot starve the rest.
                budget -= self._drain(src, min(budget, 1024), out)
            if budget > 0:
                ready = self._poller.poll(0)
        return out

    def _drain(self, src: _Source, limit: int, out: list[Delivery]) -> int:
        """Receive up to `limit` ready messages of one socket; returns how many were taken.

        Frames are received one by one without copying so that each frame's `more` flag is read
        from the frame itself: `recv_multipart` asks the socket for RCVMORE after every frame, a
        syscall-backed getsockopt that costs more than the receive (measured ~2x per message).
        The common case (next seq on a caught-up stream) is delivered here with no other work;
        everything else goes through `indexer.sequencing.on_live`."""
        recv = src.sock.recv
        tracker = src.tracker
        wid = src.worker_id
        drop = self._drop_live
        clock = time.time
        append = out.append
        n = 0
        while n < limit:
            try:
                f0 = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            n += 1
            # The frames of one message arrive together, so the later recvs cannot hit Again.
            if not f0.more:
                self._bad_frame(f"live message from {wid!r}: 1 frame")
                continue
            f1 = recv(_NOBLOCK, copy=False)
            if not f1.more:
                self._bad_frame(f"live message from {wid!r}: 2 frames")
                continue
            f2 = recv(_NOBLOCK, copy=False)
            if f2.more:
                extra = 0
                while f2.more:  # skip to the end of the oversized message
                    f2 = recv(_NOBLOCK, copy=False)
                    extra += 1
                self._bad_frame(f"live message from {wid!r}: {3 + extra} frames")
                continue
            seq_b = f1.bytes
            if len(seq_b) != SEQ_BYTES:
                self._bad_frame(f"live message from {wid!r}: seq frame of {len(seq_b)} bytes")
                continue
            seq = seq_of(seq_b)
            if drop is not None and drop(wid, seq):
                self.stats.dropped_by_hook += 1
                continue
            if tracker.take_next(seq):
                append(Batch(wid, seq, f2.bytes, clock(), False))
            else:
                self._on_live(src, seq, f2.bytes, out)
        self.stats.received += n
        return n

    def _on_live(self, src: _Source, seq: int, payload: bytes, out: list[Delivery]) -> None:
        """Everything but the in-order case: duplicates, gaps (with replay) and restarts."""
        now = time.time()
        fetch = ((lambda first, last: self._fetch_replay(src, first, last)) if src.replay_endpoint
                 else (lambda first, last: ()))
        for step in on_live(src.tracker, seq, payload, fetch):
            if isinstance(step, DeliverStep):
                out.append(Batch(src.worker_id, step.seq, step.item, now, step.replayed))
                if step.replayed:
                    self.stats.replay_batches += 1
            elif isinstance(step, GapStep):
                res = step.resolution
                self.stats.gaps += 1
                self.stats.replay_extra += res.extra
                if not res.recovered:
                    self.stats.gaps_unrecovered += 1
                    log.warning("worker %s: batches %d..%d lost (%d of %d recovered by replay); "
                                "resync needed", src.worker_id, res.first, res.last, len(res.deliver),
                                res.last - res.first + 1)
                out.append(Gap(src.worker_id, res.first, res.last, res.recovered))
            else:
                self.stats.restarts += 1
                log.warning("worker %s: seq went back from %d to %d: publisher restarted",
                            src.worker_id, step.old_seq, step.new_seq)
                out.append(Restart(src.worker_id, step.old_seq, step.new_seq))
        if src.tracker.live_last == seq and src.tracker.last != seq:
            self.stats.duplicates += 1

    def _fetch_replay(self, src: _Source, first: int, last: int) -> list[tuple[int, bytes]]:
        """Ask the publisher's replay socket for everything from `first`; stop at the end marker,
        once `last` has arrived (replies come in seq order), or after `replay_timeout` of silence."""
        assert src.replay_endpoint is not None
        self.stats.replay_requests += 1
        got: list[tuple[int, bytes]] = []
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(src.replay_endpoint)
            sock.send_multipart([b"", seq_bytes(first)])
            timeout_ms = max(1, int(self.replay_timeout * 1000))
            while True:
                if not sock.poll(timeout_ms, zmq.POLLIN):
                    self.stats.replay_timeouts += 1
                    log.warning("worker %s: replay from %s timed out after %d batches",
                                src.worker_id, src.replay_endpoint, len(got))
                    break
                parsed = parse_replay_reply(sock.recv_multipart())
                if parsed is None:
                    break
                if isinstance(parsed, str):
                    self.stats.replay_bad_frames += 1
                    log.warning("worker %s: %s", src.worker_id, parsed)
                    continue
                got.append(parsed)
                if parsed[0] >= last:
                    break
        except zmq.ZMQError as exc:
            log.warning("worker %s: replay from %s failed: %s", src.worker_id, src.replay_endpoint, exc)
        finally:
            sock.close(linger=0)
        return got

    def _bad_frame(self, why: str) -> None:
        self.stats.bad_frames += 1
        n = self.stats.bad_frames
        if n & (n - 1) == 0:  # log the 1st, 2nd, 4th, 8th ... so a flood cannot flood the log
            log.warning("dropped malformed message (%d so far): %s", n, why)
