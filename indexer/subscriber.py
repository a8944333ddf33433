"""ZeroMQ KV-event subscriber: one SUB socket per publisher, gap recovery through the replay socket.

`poll()` returns deliveries in per-worker seq order:
- `Batch`   a payload to apply (`replayed=True` when it came from the replay socket),
- `Gap`     announced *before* the batches that follow it; `recovered=False` means some batches
            are lost and the consumer must resync the worker (clear it, rebuild from what follows),
- `Restart` the publisher started over at seq 0: clear the worker, then apply what follows.
- `Run`     (only with `runs=True`) consecutive in-order live batches of one worker, received in
            one C call (`indexer.zmqdrain`); exactly the Batches `first_seq`, `first_seq + 1`, ...

Sequencing decisions are made by `indexer.sequencing` (pure); this module does the I/O.
Replays never block other publishers (docs/service.md, "Replays"): a gap starts a replay that is
polled together with the live sockets; the gapped publisher's SUB socket is parked (its live
messages wait in ZeroMQ's queue) until the replay ends — at its end marker, once the gap is
covered, after `replay_timeout` of silence, at `replay_deadline`, or past the byte / batch caps.
Every socket refuses messages above `max_msg_bytes` (ZMQ_MAXMSGSIZE: enforced before any copy).

Replies on the replay socket are accepted in both shapes found in the wild: 4 frames
`[b"", topic, seq, payload]` (design §2, TensorRT-LLM, our publisher) and 3 frames
`[b"", seq, payload]` (vLLM 0.33, SGLang 0.5.23 omit the topic), with the matching end markers.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import zmq

from indexer.deliveries import Batch, Delivery, Gap, Restart, Run
from indexer.sequencing import DeliverStep, GapStep, SeqTracker, on_live
from indexer.zmq_replay import Replay, gap_of, parse_replay_reply
from indexer.zmqdrain import OddKind, odd_message, recv_run as _recv_run
from schemas.codec import DEFAULT_MAX_PAYLOAD
from schemas.frames import SEQ_BYTES, SNAPSHOT_REQUEST, seq_bytes, seq_of

log = logging.getLogger(__name__)

_NOBLOCK = int(zmq.NOBLOCK)  # a plain int: the flag enum costs a conversion per recv


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
    reconnects: int = 0  # silent publishers reconnected (a refused oversize message ends a session)
    replay_capped: int = 0  # replays cut at the deadline or the byte / batch cap
    dropped_by_hook: int = 0
    snapshot_requests: int = 0
    # Frame-level drops by reason (wrong frame count, seq frame not 8 bytes, ...), for /metrics.
    frame_drops: dict[str, int] = msgspec.field(default_factory=dict)


_U64_MAX = (1 << 64) - 1


class _Source:
    __slots__ = ("worker_id", "endpoint", "replay_endpoint", "topic", "sock", "addr", "tracker", "replay", "last_rx")

    def __init__(self, worker_id: str, endpoint: str, replay_endpoint: str | None, topic: bytes,
                 sock: zmq.Socket, tracker: SeqTracker) -> None:
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.sock = sock
        self.addr = int(sock.underlying)  # libzmq's socket, for the C receive loop
        self.tracker = tracker
        self.replay: Replay | None = None
        self.last_rx = time.monotonic()  # last time anything arrived (or the last reconnect)


class Subscriber:
    """Connects to one or many publishers; not thread-safe (one consumer thread calls poll)."""

    __slots__ = ("_ctx", "_own_ctx", "_sources", "_by_sock", "_by_replay", "_poller", "replay_timeout",
                 "replay_deadline", "replay_max_bytes", "replay_max_batches", "max_msg_bytes",
                 "reconnect_after", "_next_reconnect_check", "_drop_live", "_max_per_poll", "_rcvhwm", "stats", "_closed",
                 "_turn", "_runs", "_recv_run")

    def __init__(
        self,
        ctx: zmq.Context | None = None,
        replay_timeout: float = 2.0,
        *,
        drop_live: Callable[[str, int], bool] | None = None,
        max_per_poll: int = 10_000,
        rcvhwm: int = 1_000_000,
        replay_deadline: float | None = None,
        replay_max_bytes: int = 256 * 1024 * 1024,
        replay_max_batches: int = 200_000,
        max_msg_bytes: int = DEFAULT_MAX_PAYLOAD,
        max_sockets: int | None = None,
        reconnect_after: float = 5.0,
        runs: bool = False,
        native_recv: bool | None = None,
    ) -> None:
        """`replay_timeout`: seconds of silence on the replay socket before giving up;
        `replay_deadline`: seconds a whole replay may take (default 5 x replay_timeout, at least
        `replay_timeout`); `replay_max_bytes` / `replay_max_batches`: a replay stops past either.
        `max_msg_bytes`: ZMQ_MAXMSGSIZE of every socket (a larger message is refused by ZeroMQ,
        which drops that connection: the loss shows up as a gap). `max_sockets`: raise the
        context's socket limit (ZMQ_MAX_SOCKETS, default 1023) to this, capped by libzmq's.
        `reconnect_after`: a publisher silent this long is reconnected — ZeroMQ ends a session
        on a protocol error such as an oversize message and does not reconnect it by itself.
        `drop_live(worker_id, seq)`: test hook — live batches it returns True for are discarded as
        if lost on the wire (counted in `stats.dropped_by_hook`).
        `runs`: deliver in-order live batches received together as one `Run` instead of Batches.
        `native_recv`: the C receive loop (None: when available; False: pyzmq frame by frame;
        True: required). Deliveries are the same either way."""
        if replay_timeout <= 0 or max_msg_bytes < 1 or replay_max_bytes < 1 or replay_max_batches < 1:
            raise ValueError("replay_timeout, max_msg_bytes and the replay caps must be positive")
        self._own_ctx = ctx is None
        self._ctx = zmq.Context() if ctx is None else ctx
        if max_sockets is not None:
            set_socket_limit(self._ctx, max_sockets)
        self._sources: dict[str, _Source] = {}
        self._by_sock: dict[zmq.Socket, _Source] = {}
        self._by_replay: dict[zmq.Socket, _Source] = {}
        self._poller = zmq.Poller()
        self.replay_timeout = replay_timeout
        self.replay_deadline = max(replay_timeout, replay_deadline if replay_deadline is not None
                                   else 5 * replay_timeout)
        self.replay_max_bytes = replay_max_bytes
        self.replay_max_batches = replay_max_batches
        self.max_msg_bytes = max_msg_bytes
        self.reconnect_after = reconnect_after
        self._next_reconnect_check = time.monotonic() + reconnect_after
        self._drop_live = drop_live
        self._max_per_poll = max_per_poll
        self._rcvhwm = rcvhwm
        self.stats = SubscriberStats()
        self._closed = False
        self._turn = 0  # rotates which ready socket is drained first (no publisher starves the rest)
        self._runs = runs
        if native_recv and _recv_run is None:
            from indexer.zmqdrain import unavailable_reason
            raise RuntimeError(f"the C receive loop is not available: {unavailable_reason}")
        # The test hook sees every message, so it takes the frame-by-frame path.
        self._recv_run = None if native_recv is False or drop_live is not None else _recv_run

    # --- membership -----------------------------------------------------------------------------

    def add(self, worker_id: str, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
            last_seq: int | None = None) -> None:
        """Subscribe to a publisher. `last_seq` is the watermark already applied (None: nothing);
        the first message triggers a replay of whatever lies between it and the watermark.
        Raises ValueError when the subscription cannot be made (bad endpoint, socket limit)."""
        if self._closed:
            raise RuntimeError("subscriber is closed")
        if worker_id in self._sources:
            raise ValueError(f"worker {worker_id!r} is already subscribed")
        tracker = SeqTracker(last_seq)  # validates last_seq
        try:
            sock = self._ctx.socket(zmq.SUB)
        except zmq.ZMQError as exc:  # EMFILE past ZMQ_MAX_SOCKETS or the fd limit
            raise ValueError(f"cannot open a socket for worker {worker_id!r}: {exc}") from exc
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_msg_bytes)
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
        if src.replay is not None:
            self._end_replay(src)
        else:
            self._poller.unregister(src.sock)
        del self._by_sock[src.sock]
        src.sock.close(linger=0)

    def workers(self) -> list[str]:
        return list(self._sources)

    @property
    def max_per_poll(self) -> int:
        """The most messages one `poll` takes: a poll that returns fewer has drained every queue."""
        return self._max_per_poll

    def frame_drops(self) -> dict[str, int]:
        """Frame-level drops (wrong frame count, bad seq frame, malformed replay replies) by reason."""
        return self.stats.frame_drops

    def replaying(self) -> list[str]:
        """Workers with a replay in flight (their live stream is parked meanwhile)."""
        return [w for w, s in self._sources.items() if s.replay is not None]

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
        """Wait up to `timeout_ms` for messages, then drain what is ready (bounded per call).
        Replays in flight are served here too and never hold up the other publishers."""
        out: list[Delivery] = []
        if self._closed or not self._sources:
            return out
        if self._by_replay:  # wake in time for the nearest replay deadline
            soonest = min(min(s.replay.deadline, s.replay.quiet_until) for s in self._by_replay.values()
                          if s.replay is not None)
            timeout_ms = max(0, min(timeout_ms, int((soonest - time.monotonic()) * 1000) + 1))
        ready = self._poller.poll(timeout_ms)
        budget = self._max_per_poll
        by_sock = self._by_sock
        while ready and budget > 0:
            # Start at a different ready socket each round and give each a fair share of the budget:
            # under a backlog, always starting with the same busy publishers starved the later ones.
            n_ready = len(ready)
            if n_ready > 1:
                k = self._turn % n_ready
                self._turn += 1
                ready = ready[k:] + ready[:k]
            share = max(64, budget // n_ready)
            for sock, _ in ready:
                if budget <= 0:
                    break
                src = by_sock.get(sock)
                if src is None:
                    rsrc = self._by_replay.get(sock)
                    if rsrc is not None:
                        budget -= self._pump_replay(rsrc, min(budget, share, 1024), out)
                    continue
                if src.replay is None:
                    # A bounded chunk per socket so one busy publisher cannot starve the rest.
                    budget -= self._drain(src, min(budget, share, 1024), out)
            if budget > 0:
                ready = self._poller.poll(0)
        now = time.monotonic()
        if now >= self._next_reconnect_check:
            self._next_reconnect_check = now + min(1.0, self.reconnect_after)
            self._reconnect_silent(now)
        if self._by_replay:
            for rsrc in list(self._by_replay.values()):
                rp = rsrc.replay
                if rp is not None and (now >= rp.deadline or now >= rp.quiet_until):
                    if now >= rp.deadline:
                        self.stats.replay_capped += 1
                        why = f"deadline of {self.replay_deadline:g}s"
                    else:
                        self.stats.replay_timeouts += 1
                        why = f"{self.replay_timeout:g}s of silence"
                    log.warning("worker %s: replay from %s ended after %s with %d batches",
                                rsrc.worker_id, rsrc.replay_endpoint, why, len(rp.got))
                    self._finish_replay(rsrc, out)
        return out

    def _drain(self, src: _Source, limit: int, out: list[Delivery]) -> int:
        """Receive up to `limit` ready messages of one socket; returns how many were taken.

        While the stream is caught up, runs of in-order messages are received by the C loop
        (`indexer.zmqdrain.recv_run`) in one call; the message that ends a run (another seq, bad
        frames) is judged here. Otherwise, and without the C loop, messages are taken one by one."""
        tracker = src.tracker
        fast = self._recv_run
        n = 0
        while n < limit:
            last = tracker.last
            # (the C loop's expected seq is a u64: the last seq of the space goes the slow way)
            if fast is not None and last is not None and tracker.live_last == last and last < _U64_MAX:
                got, payloads, odd = fast(src.addr, limit - n, last + 1, *tracker.rings())
                n += got
                if payloads:
                    tracker.last = tracker.live_last = last + len(payloads)
                    self._deliver_run(src, last + 1, payloads, out)
                if odd is None:
                    break  # nothing more ready, or the limit
                msg = odd_message(odd)
                value = msg.value
                if msg.kind is OddKind.OTHER_SEQ:
                    if self._on_live(src, value, msg.payload, out):
                        break  # a replay started: this publisher's live stream is parked until it ends
                elif msg.kind is OddKind.FRAME_COUNT:
                    self._bad_frame("frame_count", f"live message from {src.worker_id!r}: {value} frame"
                                    + ("" if value == 1 else "s"))
                else:
                    self._bad_frame("seq_frame_size", f"live message from {src.worker_id!r}: seq frame of {value} bytes")
                continue
            taken = self._take_one(src, out)
            if not taken:
                break
            n += 1
            if taken == 2:
                break  # a replay started
        if n:
            src.last_rx = time.monotonic()
        self.stats.received += n
        return n

    def _deliver_run(self, src: _Source, first: int, payloads: list[bytes], out: list[Delivery]) -> None:
        now = time.time()
        if self._runs:
            out.append(Run(src.worker_id, first, payloads, now))
        else:
            wid = src.worker_id
            out.extend(Batch(wid, first + k, p, now, False) for k, p in enumerate(payloads))

    def _take_one(self, src: _Source, out: list[Delivery]) -> int:
        """One message through pyzmq: 0 nothing ready, 1 taken, 2 taken and a replay started.

        Frames are received one by one without copying so that each frame's `more` flag is read
        from the frame itself: `recv_multipart` asks the socket for RCVMORE after every frame, a
        syscall-backed getsockopt that costs more than the receive (measured ~2x per message).
        The common case (next seq on a caught-up stream) is delivered here with no other work;
        everything else goes through `indexer.sequencing.on_live`."""
        recv = src.sock.recv
        wid = src.worker_id
        try:
            f0 = recv(_NOBLOCK, copy=False)
        except zmq.Again:
            return 0
        # The frames of one message arrive together, so the later recvs cannot hit Again.
        if not f0.more:
            self._bad_frame("frame_count", f"live message from {wid!r}: 1 frame")
            return 1
        f1 = recv(_NOBLOCK, copy=False)
        if not f1.more:
            self._bad_frame("frame_count", f"live message from {wid!r}: 2 frames")
            return 1
        f2 = recv(_NOBLOCK, copy=False)
        if f2.more:
            extra = 0
            while f2.more:  # skip to the end of the oversized message
                f2 = recv(_NOBLOCK, copy=False)
                extra += 1
            self._bad_frame("frame_count", f"live message from {wid!r}: {3 + extra} frames")
            return 1
        seq_b = f1.bytes
        if len(seq_b) != SEQ_BYTES:
            self._bad_frame("seq_frame_size", f"live message from {wid!r}: seq frame of {len(seq_b)} bytes")
            return 1
        seq = seq_of(seq_b)
        drop = self._drop_live
        if drop is not None and drop(wid, seq):
            self.stats.dropped_by_hook += 1
            return 1
        tracker = src.tracker
        if tracker.take_next(seq):
            payload = f2.bytes
            tracker.remember(seq, payload)
            self._deliver_run(src, seq, [payload], out)
            return 1
        return 2 if self._on_live(src, seq, f2.bytes, out) else 1

    def _reconnect_silent(self, now: float) -> None:
        for src in self._sources.values():
            if src.replay is None and now - src.last_rx > self.reconnect_after:
                src.last_rx = now
                try:
                    src.sock.disconnect(src.endpoint)
                except zmq.ZMQError:
                    pass  # the session was already gone
                try:
                    src.sock.connect(src.endpoint)
                except zmq.ZMQError as exc:
                    log.warning("worker %s: reconnect to %s failed: %s", src.worker_id, src.endpoint, exc)
                    continue
                self.stats.reconnects += 1
                log.debug("worker %s: silent for %.1fs, reconnected", src.worker_id, self.reconnect_after)

    def _on_live(self, src: _Source, seq: int, payload: bytes, out: list[Delivery],
                 replayed: list[tuple[int, bytes]] | None = None) -> bool:
        """Everything but the in-order case: duplicates, gaps (with replay) and restarts.
        Returns True when a replay was started instead (the message is kept until it ends)."""
        if replayed is None and src.tracker.stale_copy(seq, payload):
            self.stats.duplicates += 1  # a late copy of a delivered batch: no restart, no replay
            return False
        if replayed is None and src.replay_endpoint is not None:
            gap = gap_of(src.tracker, seq)
            if gap is not None and self._start_replay(src, seq, payload, *gap):
                return True
        now = time.time()
        got = replayed if replayed is not None else ()
        for step in on_live(src.tracker, seq, payload, lambda first, last: got):
            if isinstance(step, DeliverStep):
                src.tracker.remember(step.seq, step.item)
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
        return False

    # --- replays: a state machine polled with the live sockets ------------------------------------

    def _start_replay(self, src: _Source, seq: int, payload: bytes, first: int, last: int) -> bool:
        """Ask for `first`.. and park the live socket; False when the request cannot be sent
        (the gap is then handled at once as not covered)."""
        assert src.replay_endpoint is not None
        self.stats.replay_requests += 1
        try:
            sock = self._ctx.socket(zmq.DEALER)
        except zmq.ZMQError as exc:
            log.warning("worker %s: cannot open a replay socket: %s", src.worker_id, exc)
            return False
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_msg_bytes)
            sock.setsockopt(zmq.RCVHWM, 1000)  # the rest waits at the publisher, not in our RSS
            sock.connect(src.replay_endpoint)
            sock.send_multipart([b"", seq_bytes(first)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("worker %s: replay from %s failed: %s", src.worker_id, src.replay_endpoint, exc)
            sock.close(linger=0)
            return False
        now = time.monotonic()
        src.replay = Replay(sock, seq, payload, first, last, now + self.replay_deadline,
                             now + self.replay_timeout)
        self._poller.unregister(src.sock)
        self._poller.register(sock, zmq.POLLIN)
        self._by_replay[sock] = src
        return True

    def _pump_replay(self, src: _Source, limit: int, out: list[Delivery]) -> int:
        """Take up to `limit` ready replies; end the replay when it is complete or over a cap."""
        rp = src.replay
        if rp is None:
            return 0
        n = 0
        done = False
        while n < limit:
            try:
                frames = rp.sock.recv_multipart(_NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                log.warning("worker %s: replay from %s failed: %s", src.worker_id, src.replay_endpoint, exc)
                done = True
                break
            n += 1
            rp.quiet_until = time.monotonic() + self.replay_timeout
            rp.nbytes += sum(len(f) for f in frames)
            parsed = parse_replay_reply(frames)
            if parsed is None:
                done = True
                break
            if isinstance(parsed, str):
                self.stats.replay_bad_frames += 1
                self._bad_frame("replay_frame", f"worker {src.worker_id!r}: {parsed}")
            else:
                rp.got.append(parsed)
                if parsed[0] >= rp.last:
                    done = True
                    break
            if rp.nbytes > self.replay_max_bytes or len(rp.got) >= self.replay_max_batches:
                self.stats.replay_capped += 1
                log.warning("worker %s: replay from %s cut at %d bytes / %d batches", src.worker_id,
                            src.replay_endpoint, rp.nbytes, len(rp.got))
                done = True
                break
        if done:
            self._finish_replay(src, out)
        return n

    def _end_replay(self, src: _Source) -> Replay | None:
        rp = src.replay
        if rp is None:
            return None
        src.replay = None
        self._poller.unregister(rp.sock)
        del self._by_replay[rp.sock]
        rp.sock.close(linger=0)
        if src.worker_id in self._sources:
            self._poller.register(src.sock, zmq.POLLIN)  # the live stream resumes
        return rp

    def _finish_replay(self, src: _Source, out: list[Delivery]) -> None:
        rp = self._end_replay(src)
        if rp is not None:
            self._on_live(src, rp.seq, rp.payload, out, replayed=rp.got)

    def _bad_frame(self, reason: str, why: str) -> None:
        drops = self.stats.frame_drops
        drops[reason] = drops.get(reason, 0) + 1
        self.stats.bad_frames += 1
        n = self.stats.bad_frames
        if n & (n - 1) == 0:  # log the 1st, 2nd, 4th, 8th ... so a flood cannot flood the log
            log.warning("dropped malformed message (%d so far): %s", n, why)


def set_socket_limit(ctx: zmq.Context, wanted: int) -> int:
    """Raise the context's ZMQ_MAX_SOCKETS (default 1023) towards `wanted`, capped by libzmq's
    own limit, and the process's open-file soft limit with it (each socket needs descriptors).
    Returns the limit in force. Must run before the context's first socket."""
    cap = int(ctx.get(zmq.SOCKET_LIMIT))
    n = max(1, min(wanted, cap))
    if n > int(ctx.get(zmq.MAX_SOCKETS)):
        ctx.set(zmq.MAX_SOCKETS, n)
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = 2 * n + 256
        if soft != resource.RLIM_INFINITY and soft < need:
            new = need if hard == resource.RLIM_INFINITY else min(need, hard)
            if new > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ImportError, ValueError, OSError) as exc:  # not fatal: the socket limit still applies
        log.warning("cannot raise the open-file limit: %s", exc)
    return int(ctx.get(zmq.MAX_SOCKETS))


ZmqSubscriber = Subscriber  # the name that says which transport (indexer.protocol.Subscriber is the seam)
