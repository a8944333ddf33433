"""The live ingestion thread: the shell that owns the ZMQ Subscriber, applies its Deliveries to
the Index in order per worker, and carries out the reconciliation policy's decisions
(indexer.reconcile, docs/service.md) as index clears, snapshot requests, metrics and logs. The
policy itself — what a gap, a restart, expired orphans or silence mean — is not written here.

Threading: the Subscriber's sockets are touched only by this thread; the HTTP side asks for
subscription changes through a command queue. The shared `lock` guards the index and the registry
together and is held for one batch at a time, so /score never waits for more than one batch and
ingestion never waits for more than one query.

Fast path: the raw payload goes straight to `Index.apply_payload(..., rank_from_batch=True)`,
which reads the batch's dp_rank and ts in the same C walk that hashes token ids from the msgpack
bytes and applies them; odd payloads (array-form events, bad bytes) take the index's general paths,
which read the head in Python or use the full decoder (and give the exact error label).

Runs: the subscriber hands in-order live batches received together over as one `Run`; they are
applied by `Index.apply_run` in one C call under one hold of the lock (at most `RUN_HOLD` = 64
batches a hold, ~0.3 ms) and reported to the policy by `reconcile.on_run`. A batch the run
does not cover (a heartbeat, another rank, an orphan, odd bytes) goes the one-by-one way above,
and the run resumes after it; the outcome is the same as applying every batch alone
(tests/test_ingest_runs.py).

Resync: when the policy resyncs a worker its publisher is asked for a snapshot if the subscriber
can (`request_snapshot`): a kvatlas producer answers in-stream with AllBlocksCleared + its full
state, and that AllBlocksCleared makes the stream clean again.

Ingest shards (`--ingest-shards N`, N >= 2): `IngestSet` runs N loops over an
`indexer.sharded.ShardedIndex`, each with its own thread, subscriber (the sockets of its workers:
`shard_of(worker_id) == i`) and lock (`ShardedLock.shard(i)`, router_api/locks.py). A loop's
per-batch holds touch only its own workers — their index shard, their registry entries — so the
loops apply in parallel. What spans workers (the policy tick, run by loop 0 only) takes
`global_lock`, the whole ShardedLock, and only with nothing else held; callbacks into the service
(which take the whole lock themselves) are called with no lock held.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from indexer import reconcile
from indexer.deliveries import Batch, Delivery, Gap, Restart, Run
from indexer.protocol import Index, Subscriber
from router_api.locks import ShardedLock
from router_api.memtrim import MemoryTrimmer
from router_api.metrics import ServiceMetrics
from router_api.ingest_stats import ApplyAdapter, Tally
from router_api.registry import Registry, RegisteredWorker
from schemas.api import RegisterWorker

log = logging.getLogger("kvatlas.ingest")

# How many of each kind of bad input are logged in full before we only count them.
_LOG_FIRST = 20

# A worker whose events are dropped is named in a WARNING at most once per this many seconds.
DROP_WARN_INTERVAL_S = 60.0

# The most batches of a run applied under one hold of the lock (~0.3 ms): /score waits at most that.
RUN_HOLD = 64


class _Cmd:
    __slots__ = ("kind", "reg", "last_seq", "worker_id", "done", "error")

    def __init__(self, kind: str, *, reg: RegisterWorker | None = None, last_seq: int | None = None,
                 worker_id: str = "", done: threading.Event | None = None) -> None:
        self.kind = kind
        self.reg = reg
        self.last_seq = last_seq
        self.worker_id = worker_id
        self.done = done
        self.error: str | None = None  # set when the subscription could not be made


class Subscription:
    """The answer to `IngestLoop.subscribe`: `wait()` returns None once subscribed, else why not."""

    __slots__ = ("_cmd",)

    def __init__(self, cmd: _Cmd) -> None:
        self._cmd = cmd

    def wait(self, timeout: float) -> str | None:
        assert self._cmd.done is not None
        if not self._cmd.done.wait(timeout):
            return f"the ingest thread did not subscribe within {timeout:g}s"
        return self._cmd.error

    def is_set(self) -> bool:
        return self._cmd.done is not None and self._cmd.done.is_set()


class IngestLoop:
    """Runs `Subscriber.poll` in its own thread and applies everything it delivers.

    Locks: `lock` is held for one batch / one run chunk / one gap or restart of one worker (its index
    entries and its registry state); `global_lock` (default: `lock`) for what reads or changes every
    worker (the tick), taken only with `lock` not held. One loop: both are the service's lock."""

    def __init__(
        self,
        *,
        index: Index,
        registry: Registry,
        lock: threading.Lock,
        metrics: ServiceMetrics,
        subscriber_factory: Callable[[], Subscriber],
        on_expired: Callable[[str], None] | None = None,
        on_subscribe_failed: Callable[[str, str, RegisterWorker | None], None] | None = None,
        poll_ms: int = 20,
        tick_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        trimmer: MemoryTrimmer | None = None,
        global_lock: threading.Lock | ShardedLock | None = None,
        ticks: bool = True,
        name: str = "kvatlas-ingest",
    ) -> None:
        """`ticks`: run the liveness policy's tick (exactly one loop of a service does);
        `name`: the thread's."""
        self.index = index
        self.registry = registry
        self.lock = lock
        self.global_lock = lock if global_lock is None else global_lock
        self._ticks = ticks
        self._name = name
        self.metrics = metrics
        self.adapter = ApplyAdapter(index, metrics)
        self._subscriber_factory = subscriber_factory
        self._on_expired = on_expired
        self._on_subscribe_failed = on_subscribe_failed
        self._frame_drops: dict[str, int] = {}  # the subscriber's frame-drop counts already exported
        self._poll_ms = poll_ms
        self._tick_s = tick_s
        self._clock = clock
        self._wall = wall
        self._cmds: queue.SimpleQueue[_Cmd] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._logged: dict[str, int] = {}
        self._drop_warned: dict[str, float] = {}  # per worker, when its drops were last named in a WARNING
        self._sub: Subscriber | None = None  # set by the thread; only the thread uses it
        # Returns burst buffers to the OS once ingestion goes idle (see router_api.memtrim).
        self.trimmer = trimmer if trimmer is not None else MemoryTrimmer()
        self._tally = Tally()  # this poll's metric increments, flushed once per poll
        self._rank: dict[str, int] = {}  # per worker, the dp_rank its last batch applied to (a run's guess)
        self.applied_batches = 0  # read by /health and the dashboard
        self.deliveries = 0  # every Batch/Gap/Restart handled (snapshots skip when unchanged)
        self.last_error: str | None = None

    # -- control (any thread) ----------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("ingest loop already started")
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the thread to finish its turn and stop (`stop` also waits for it)."""
        self._stop.set()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def owns(self, thread: threading.Thread) -> bool:
        """Whether `thread` is this loop's (a call from it must not wait for the loop)."""
        return self._thread is not None and thread is self._thread

    def subscribe(self, reg: RegisterWorker, last_seq: int | None = None) -> Subscription:
        """Queue a subscription; a failure is also reported to `on_subscribe_failed` (which
        undoes the registration), so nobody is left `connecting` forever."""
        cmd = _Cmd("add", reg=reg, last_seq=last_seq, done=threading.Event())
        self._cmds.put(cmd)
        return Subscription(cmd)

    def unsubscribe(self, worker_id: str) -> threading.Event:
        done = threading.Event()
        self._cmds.put(_Cmd("remove", worker_id=worker_id, done=done))
        return done

    # -- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        sub = self._sub = self._subscriber_factory()
        next_tick = self._clock()
        log.info("event=ingest_started poll_ms=%d", self._poll_ms)
        try:
            while not self._stop.is_set():
                next_tick = self.step(sub, self._poll_ms, next_tick)
        finally:
            self._drain_commands(sub)
            try:
                sub.close()
            except Exception:
                log.exception("event=subscriber_close_failed")
            log.info("event=ingest_stopped batches=%d", self.applied_batches)

    def step(self, sub: Subscriber, poll_ms: int, next_tick: float) -> float:
        """One turn of the loop: commands, one poll, its deliveries, the tick when due. Returns the
        next tick time. The thread calls it in a loop; bench/bench_ingest.py drives it directly."""
        self._drain_commands(sub)
        if not sub.workers():
            # Nothing to poll (an empty poll returns at once): wait for a command instead of spinning.
            self._wait_command(sub, poll_ms / 1000.0)
        applied0 = self.applied_batches
        try:
            deliveries = sub.poll(poll_ms)
        except Exception as exc:  # a subscriber bug must not kill ingestion silently
            self.last_error = repr(exc)
            self.metrics.drops.inc("subscriber_error")
            log.exception("event=subscriber_error")
            self._stop.wait(0.05)  # back off briefly instead of spinning on a broken poll
            return next_tick
        self._export_frame_drops(sub)
        if deliveries:
            handle = self._handle
            try:
                for d in deliveries:
                    handle(d)
            finally:
                self._tally.flush(self.metrics)
        now = self._clock()
        batches = self.applied_batches - applied0  # a Run delivers many
        if batches:
            self.trimmer.note(batches)
        # A poll that took less than it may has drained the queues: a burst's buffers are free now.
        if batches < sub.max_per_poll and self.trimmer.maybe_trim(now):
            log.debug("event=memory_trimmed trims=%d", self.trimmer.trims)
        if now >= next_tick:
            next_tick = now + self._tick_s
            if self._ticks:
                self._tick(now)
        return next_tick

    def _wait_command(self, sub: Subscriber, timeout: float) -> None:
        try:
            cmd = self._cmds.get(timeout=timeout)
        except queue.Empty:
            return
        self._run_command(sub, cmd)
        self._drain_commands(sub)

    def _drain_commands(self, sub: Subscriber) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            self._run_command(sub, cmd)

    def _run_command(self, sub: Subscriber, cmd: _Cmd) -> None:
        """One subscription change (only this thread touches the subscriber)."""
        try:
            if cmd.kind == "add" and cmd.reg is not None:
                r = cmd.reg
                sub.add(r.worker_id, r.endpoint, replay_endpoint=r.replay_endpoint, topic=r.topic,
                        last_seq=cmd.last_seq)
                log.info("event=subscribed worker=%s endpoint=%s replay=%s from_seq=%s",
                         r.worker_id, r.endpoint, r.replay_endpoint,
                         0 if cmd.last_seq is None else cmd.last_seq + 1)
            elif cmd.kind == "remove":
                sub.remove(cmd.worker_id)
                self._rank.pop(cmd.worker_id, None)
                self._drop_warned.pop(cmd.worker_id, None)
                log.info("event=unsubscribed worker=%s", cmd.worker_id)
        except Exception as exc:
            self.metrics.drops.inc("subscribe_error")
            wid = cmd.reg.worker_id if cmd.reg else cmd.worker_id
            log.error("event=subscribe_error kind=%s worker=%s error=%r", cmd.kind, wid, exc)
            if cmd.kind == "add":
                cmd.error = str(exc)
                if self._on_subscribe_failed is not None:  # takes the service's lock: none is held here
                    try:
                        self._on_subscribe_failed(wid, str(exc), cmd.reg)
                    except Exception:
                        log.exception("event=subscribe_rollback_failed worker=%s", wid)
        finally:
            if cmd.done is not None:
                cmd.done.set()

    def _export_frame_drops(self, sub: Subscriber) -> None:
        """Frame-level drops seen by the subscriber (wrong frame count, bad seq frame, malformed
        replay replies) -> `kvatlas_drops_total{reason="frame_<reason>"}`."""
        drops = sub.frame_drops()
        if not drops:
            return
        seen = self._frame_drops
        for reason, n in list(drops.items()):
            old = seen.get(reason, 0)
            if n > old:
                self.metrics.drops.inc("frame_" + reason, amount=float(n - old))
                seen[reason] = n

    def _handle(self, d: Delivery) -> None:
        self.deliveries += 1
        if type(d) is Run:
            self._on_run(d)
        elif type(d) is Batch:
            self._on_batch(d.worker_id, d.seq, d.payload, d.replayed)
        elif type(d) is Gap:
            self._on_seq_event(d)
        elif type(d) is Restart:
            self._on_seq_event(d)
        else:
            self._count_bad("unknown_delivery", f"unknown delivery {type(d).__name__}")

    def _count_bad(self, reason: str, message: str) -> None:
        self.metrics.drops.inc(reason)
        n = self._logged.get(reason, 0) + 1
        self._logged[reason] = n
        if n <= _LOG_FIRST or n % 1000 == 0:
            log.warning("event=dropped reason=%s count=%d detail=%s", reason, n, message)

    def _on_run(self, d: Run) -> None:
        """In-order live batches `d.first_seq`..: whole common-case stretches in one index call,
        anything else one by one (`_on_batch`)."""
        wid = d.worker_id
        payloads = d.payloads
        n = len(payloads)
        i = 0
        tally = self._tally
        while i < n:
            k = 0
            extra = None
            whole = False  # the index took the whole chunk: nothing to apply one by one yet
            now = self._clock()
            with self.lock:  # one stretch per hold: /score waits for at most one run
                state = self.registry.get(wid)
                if state is None:  # removed while its messages were in flight
                    self.metrics.drops.inc("unregistered_worker", amount=float(n - i))
                    return
                rank = self._rank.get(wid, state.reg.dp_rank)
                try:
                    chunk = payloads if i == 0 and n <= RUN_HOLD else payloads[i:i + RUN_HOLD]
                    k, stats, extra = self.index.apply_run(state.reg.model, wid, rank, state.reg.dp_rank, chunk)
                    whole = k == len(chunk) and extra is None
                except Exception as exc:  # the index promises not to raise; the batch goes one by one
                    self._count_bad("apply_error", f"worker={wid} seq={d.first_seq + i}: {exc!r}")
                    k, extra = 0, None
                if k:
                    cleared = tally.add_stats(stats)[1]
                    if stats.drops:
                        self._worker_dropped(state, stats.drops, now)
                    reconcile.on_run(state, d.first_seq + i + k - 1, k, now, cleared)
                    self.registry.add_rank(state, rank)
                    if stats.ts > 0:
                        lag = self._wall() - stats.ts
                        state.lag = lag = lag if lag > 0.0 else 0.0
                        tally.lag[(wid,)] = lag
                        self.metrics.visibility.add(lag)
            if k:
                self.applied_batches += k
                key = (wid, "live")
                tally.batches[key] = tally.batches.get(key, 0) + k
                i += k
            if i < n and not whole:  # the batch the run stopped before (or partly applied: `extra`)
                self._on_batch(wid, d.first_seq + i, payloads[i], False, extra)
                i += 1

    def _on_batch(self, wid: str, seq: int, payload: bytes, replayed: bool, applied: Any = None) -> None:
        """One batch; `applied`: its ApplyStats when the index already applied it (`apply_run`)."""
        now = self._clock()
        tally = self._tally
        heartbeat = False
        lag = None
        bad: str | None = None  # the decode_* reason of a payload that does not decode
        decision = reconcile.NOTHING
        with self.lock:  # one batch per hold: /score waits for at most this batch
            state = self.registry.get(wid)
            if state is None:  # removed while its messages were in flight
                self.metrics.drops.inc("unregistered_worker")
                return
            model = state.reg.model
            dp_rank: int | None = None
            orphans = cleared = False
            if applied is not None:
                stats = applied
            else:
                try:
                    stats = self.adapter.apply_payload(model, wid, state.reg.dp_rank, payload)
                except Exception as exc:  # the index promises not to raise; never trust it blindly
                    self._count_bad("apply_error", f"worker={wid} seq={seq}: {exc!r}")
                    self._worker_dropped(state, {"apply_error": 1}, now)
                    stats = None
            if stats is not None:
                bad = None
                if stats.drops:
                    bad = reconcile.whole_batch_drop(stats.drops)
                    self._worker_dropped(state, stats.drops, now)
                if bad is None:
                    dp_rank = stats.dp_rank
                    if stats.n_events:
                        orphans, cleared = tally.add_stats(stats)
                    else:
                        heartbeat = True
                    if stats.ts > 0:
                        lag = self._wall() - stats.ts
            decision = reconcile.on_batch(state, seq, now, self.registry.policy, heartbeat, cleared, orphans)
            # What the API reports beyond the policy: the batch's rank and lag.
            if dp_rank is not None:
                if dp_rank not in state.dp_ranks:
                    self.registry.add_rank(state, dp_rank)
                self._rank[wid] = dp_rank
            if lag is not None:
                state.lag = lag if lag > 0.0 else 0.0
            if decision.clear:
                self.index.clear_worker(model, wid)
        if bad is not None:
            self._count_bad(bad, f"worker={wid} seq={seq}: payload does not decode")
        self.applied_batches += 1
        key = (wid, "replayed" if replayed else ("heartbeat" if heartbeat else "live"))
        tally.batches[key] = tally.batches.get(key, 0) + 1
        if lag is not None:
            tally.lag[(wid,)] = lag = lag if lag > 0.0 else 0.0
            if not replayed and not heartbeat:
                self.metrics.visibility.add(lag)
        if decision is not reconcile.NOTHING:
            self._carry_out(decision, wid, f"seq={seq}")

    def _carry_out(self, decision: reconcile.Decision, wid: str, where: str) -> None:
        """The counting and asking half of a reconciliation decision (the clear ran under the lock)."""
        if decision.replayed:
            self.metrics.replays.inc(wid)
            log.info("event=gap_replayed worker=%s %s", wid, where)
        if decision.restart:
            self.metrics.restarts.inc(wid)
            log.warning("event=publisher_restart worker=%s %s", wid, where)
        if decision.resync is not None:
            self.metrics.resyncs.inc(wid)
            log.warning("event=resync worker=%s reason=%s %s", wid, decision.resync, where)
            self._request_snapshot(wid)
        if decision.drop is not None:
            self._count_bad(decision.drop, f"worker={wid} {where}")
            with self.lock:
                state = self.registry.get(wid)
                if state is not None:
                    self._worker_dropped(state, {decision.drop: 1}, self._clock())

    def _worker_dropped(self, state: RegisteredWorker, drops: dict[str, int], now: float) -> None:
        """Count `drops` (reason -> events) against the worker: its status (`WorkerStatus.drops`,
        `dropping`), `kvatlas_worker_drops_total`, and a WARNING naming it, at most one per worker per
        DROP_WARN_INTERVAL_S. Called with the worker's lock held."""
        if not state.note_drops(drops, now):
            return
        wid = state.worker_id
        per = self._tally.worker_drops
        for reason, n in drops.items():
            if n > 0:
                per[(wid, reason)] = per.get((wid, reason), 0) + n
        last = self._drop_warned.get(wid)
        if last is None or now - last >= DROP_WARN_INTERVAL_S:
            self._drop_warned[wid] = now
            log.warning("event=worker_dropping worker=%s drops=%s: events of this worker are dropped, its /score "
                        "rows may lack blocks it holds (GET /workers/%s)", wid,
                        ",".join(f"{r}:{n}" for r, n in sorted(state.drops.items())), wid)

    def _request_snapshot(self, wid: str) -> None:
        """Ask the worker's publisher to re-publish its state in-stream (kvatlas producers do;
        engines ignore it). Its AllBlocksCleared, when it arrives, ends the resync."""
        sub = self._sub
        if sub is None:
            return
        try:
            outcome = "sent" if sub.request_snapshot(wid) else "not_sent"
        except Exception as exc:  # a subscriber bug must not kill ingestion
            outcome = "error"
            log.error("event=snapshot_request_error worker=%s error=%r", wid, exc)
        self.metrics.snapshot_requests.inc(wid, outcome)
        log.info("event=snapshot_requested worker=%s outcome=%s", wid, outcome)

    def _on_seq_event(self, d: Gap | Restart) -> None:
        """A Gap or a Restart: the policy decides; a clear happens under the lock, before any
        batch that follows it is applied."""
        wid = d.worker_id
        now = self._clock()
        with self.lock:
            state = self.registry.get(wid)
            if state is None:
                return
            if isinstance(d, Gap):
                decision = reconcile.on_gap(state, d.first, d.last, now, self.registry.policy,
                                            recovered=d.recovered)
            else:
                decision = reconcile.on_restart(state, now)
            if decision.clear:
                self.index.clear_worker(state.reg.model, wid)
        if isinstance(d, Gap):
            self.metrics.gaps.inc(wid)
            self._carry_out(decision, wid, f"first={d.first} last={d.last}")
        else:
            self._carry_out(decision, wid, f"old_seq={d.old_seq} new_seq={d.new_seq}")

    def _tick(self, now: float) -> None:
        # Every worker's state, other loops' workers too: the global lock (nothing else is held here).
        with self.global_lock:
            changes, expired = reconcile.on_tick(self.registry, now, self.registry.policy)
        for wid, old, new in changes:
            log.info("event=status worker=%s from=%s to=%s", wid, old, new)
        for wid in expired:
            log.warning("event=expired worker=%s reason=silent_past_remove_deadline", wid)
            if self._on_expired is not None:  # takes the service's lock: called with none held
                self._on_expired(wid)


class IngestSet:
    """N ingest loops, one per index shard, behind what the service uses of one `IngestLoop`:
    start/stop, (un)subscribe routed to the worker's loop (`shard_of`), liveness and counters summed
    over the loops. Loop i receives and applies only the workers with `shard_of(worker_id) == i`."""

    __slots__ = ("loops", "_shard_of")

    def __init__(self, loops: list[IngestLoop], shard_of: Callable[[str], int]) -> None:
        if len(loops) < 2:
            raise ValueError("an ingest set needs at least two loops (one loop is an IngestLoop)")
        self.loops = list(loops)
        self._shard_of = shard_of

    def loop_of(self, worker_id: str) -> IngestLoop:
        return self.loops[self._shard_of(worker_id)]

    # -- control (any thread) ----------------------------------------------------------------
    def start(self) -> None:
        for loop in self.loops:
            loop.start()

    def stop(self, timeout: float = 5.0) -> None:
        for loop in self.loops:  # all asked first: they wind down in parallel
            loop.request_stop()
        deadline = time.monotonic() + timeout
        for loop in self.loops:
            loop.stop(max(0.0, deadline - time.monotonic()))

    def subscribe(self, reg: RegisterWorker, last_seq: int | None = None) -> Subscription:
        return self.loop_of(reg.worker_id).subscribe(reg, last_seq)

    def unsubscribe(self, worker_id: str) -> threading.Event:
        return self.loop_of(worker_id).unsubscribe(worker_id)

    # -- state (read by /health, snapshots, the dashboard) --------------------------------------
    @property
    def alive(self) -> bool:
        """Every loop runs (one dead loop leaves its workers unread: the service is degraded)."""
        return all(loop.alive for loop in self.loops)

    @property
    def threads(self) -> list[threading.Thread | None]:
        return [loop.thread for loop in self.loops]

    def owns(self, thread: threading.Thread) -> bool:
        return any(loop.owns(thread) for loop in self.loops)

    @property
    def applied_batches(self) -> int:
        return sum(loop.applied_batches for loop in self.loops)

    @property
    def deliveries(self) -> int:
        return sum(loop.deliveries for loop in self.loops)

    @property
    def last_error(self) -> str | None:
        """The first loop's last subscriber error, in loop order (None when none had one)."""
        return next((loop.last_error for loop in self.loops if loop.last_error is not None), None)
