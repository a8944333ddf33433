"""Offline replay of recorded event logs (design §7): the decision core behind `kvatlas replay`.

No I/O beyond what callers hand in, no threads, no clocks: the shell (cli/replay.py)
opens files, measures time, paces and owns sockets.

Applying a log runs the same reconciliation policy as live ingestion (indexer.reconcile,
docs/service.md), so a log applied here ends in the state the live indexer reached from the same
stream. What is offline-specific lives here:
- per worker, every frame goes through `indexer.sequencing.on_live` with a replay fetch that
  returns nothing — the log already holds every batch the live subscriber recovered, so a seq jump
  in the log is a gap nobody could fill (the policy clears the worker, a resync);
- the policy's stream time is each frame's recv_ts; there is no publisher to ask for a snapshot;
- the batch's event tags are read from its head so the summary can count events by type.
Known difference: when a live replay filled a gap only partly, the log shows two jumps where the
live subscriber saw one gap, and the offline replay clears twice (losing the partly replayed run).

Queries (`--queries`) are answered against the index as of their time: a query at time t sees
exactly the frames, in log order, before the first frame whose recv_ts is later than t.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Union

import msgspec

from indexer.eventlog import LogFrame
from indexer import reconcile
from indexer.protocol import Index
from indexer.sequencing import DeliverStep, GapStep, SeqTracker, on_live
from schemas.batchhead import read_head as _read_head
from schemas.codec import DecodeError, decode_batch
from schemas.events import BlockStored, KVEventBatch

log = logging.getLogger(__name__)

# A query `t` below this is an offset from the log's first frame, at or above an epoch timestamp
# (1e9 s is September 2001: no recorded log starts earlier, no offset runs that long).
EPOCH_THRESHOLD = 1e9
_LOG_FIRST = 20  # bad inputs of one kind logged in full before we only count them


# --- query file -------------------------------------------------------------------------------------

class QueryLine(msgspec.Struct, omit_defaults=True):
    """One line of a `--queries` JSONL file. Unknown fields are ignored; `id` is echoed back."""

    t: float
    token_ids: list[int]
    model: Union[str, None] = None
    lora_name: Union[str, None] = None
    cache_salt: Union[str, None] = None
    id: Union[str, int, None] = None


class QueryFileError(ValueError):
    """A query file line is not a valid query; the message names the line."""


class TimedQuery:
    """A parsed query with its 1-based line number and the absolute time it is answered at."""

    __slots__ = ("line", "query", "at")

    def __init__(self, line: int, query: QueryLine, at: float = 0.0) -> None:
        self.line = line
        self.query = query
        self.at = at


_query_decoder = msgspec.json.Decoder(QueryLine)


def parse_queries(lines: Iterable[bytes | str]) -> list[TimedQuery]:
    """Parse JSONL query lines (blank lines skipped). Raises QueryFileError naming the first bad line."""
    out: list[TimedQuery] = []
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            q = _query_decoder.decode(raw)
        except msgspec.ValidationError as exc:
            raise QueryFileError(f"line {n}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise QueryFileError(f"line {n}: not a JSON object ({exc})") from None
        if q.t != q.t or q.t in (float("inf"), float("-inf")):
            raise QueryFileError(f"line {n}: t must be a finite number")
        if any(not 0 <= tok < (1 << 32) for tok in q.token_ids):
            raise QueryFileError(f"line {n}: token ids must lie in [0, 2**32)")
        out.append(TimedQuery(n, q))
    return out


def resolve_query_times(queries: list[TimedQuery], first_ts: float | None, mode: str = "auto") -> str:
    """Set each query's absolute time and sort them by it (stable). `mode`: "offset" (seconds after
    the first frame), "absolute" (a recv_ts), or "auto" (offsets when every t < EPOCH_THRESHOLD,
    absolute when every t is at or above it). Returns the mode used; raises QueryFileError when
    auto finds both kinds."""
    if mode not in ("auto", "offset", "absolute"):
        raise ValueError(f"unknown query time mode {mode!r}")
    if mode == "auto" and queries:
        small = [q.line for q in queries if q.query.t < EPOCH_THRESHOLD]
        if small and len(small) < len(queries):
            big = next(q.line for q in queries if q.query.t >= EPOCH_THRESHOLD)
            raise QueryFileError(f"line {small[0]} has an offset t but line {big} an absolute "
                                 f"timestamp; use one kind (or --query-time)")
        mode = "offset" if small else "absolute"
    base = (first_ts or 0.0) if mode == "offset" else 0.0
    for q in queries:
        q.at = base + q.query.t
    queries.sort(key=lambda q: q.at)
    return mode


class QueryAnswer(msgspec.Struct):
    """One line of the answers file."""

    line: int
    id: Union[str, int, None]
    t: float
    at: float  # absolute time the query was answered at
    frames_applied: int  # frames of the log applied before it
    model: str
    query_blocks: int = 0
    block_size: int = 0
    workers: list[dict] = msgspec.field(default_factory=list)
    error: Union[str, None] = None


# --- applying a log ---------------------------------------------------------------------------------

class WorkerReplay:
    """What the replay saw of one publisher (worker): its seq tracker, the reconciliation policy's
    stream state (batches, gaps, restarts, resyncs, clean) and the log-level counts."""

    __slots__ = ("tracker", "stream", "frames", "first_seq", "last_seq", "dp_ranks")

    def __init__(self, worker_id: str, now: float) -> None:
        self.tracker = SeqTracker()
        self.stream = reconcile.StreamState(worker_id, now)
        self.frames = 0
        self.first_seq: int | None = None
        self.last_seq: int | None = None
        self.dp_ranks: set[int] = set()


class WorkerSummary(msgspec.Struct):
    worker_id: str
    frames: int
    batches: int
    heartbeats: int
    gaps: int
    missing_seqs: int
    restarts: int
    resyncs: int
    first_seq: Union[int, None]
    last_seq: Union[int, None]
    blocks: dict[str, dict[str, int]]  # dp_rank (as str, JSON keys) -> tier -> blocks


class ReplaySummary(msgspec.Struct):
    log: str
    model: str
    block_size: int
    frames: int
    batches: int
    heartbeats: int
    bytes: int
    truncated: bool
    corrupt_frames: int
    events: dict[str, int]  # event type -> events
    blocks: dict[str, int]  # "type/medium/outcome" -> blocks
    drops: dict[str, int]  # reason -> count
    gaps: int
    restarts: int
    resyncs: int
    queries: int
    elapsed_s: float
    frames_per_s: float
    workers: list[WorkerSummary]


class LogReplayer:
    """Applies log frames to an index the way live ingestion would. Callers serialise access."""

    __slots__ = ("index", "model", "default_dp_rank", "workers", "frames", "batches", "heartbeats",
                 "events", "blocks", "drops", "policy", "_logged")

    def __init__(self, index: Index, model: str, block_size: int, default_dp_rank: int = 0) -> None:
        index.ensure_model(model, block_size)
        self.index = index
        # Liveness plays no part offline; the policy's stream rules are the live ones.
        self.policy = reconcile.LivenessPolicy()
        self.model = model
        self.default_dp_rank = default_dp_rank
        self.workers: dict[str, WorkerReplay] = {}
        self.frames = 0
        self.batches = 0
        self.heartbeats = 0
        self.events: dict[str, int] = {}
        self.blocks: dict[str, int] = {}
        self.drops: dict[str, int] = {}
        self._logged: dict[str, int] = {}

    def apply_frame(self, frame: LogFrame) -> None:
        self.frames += 1
        wid = frame.worker
        w = self.workers.get(wid)
        if w is None:
            w = self.workers[wid] = WorkerReplay(wid, frame.recv_ts)
            # The live service registers every worker (at its configured dp_rank) before any event.
            self.index.register_worker(self.model, wid, self.default_dp_rank)
        w.frames += 1
        if not isinstance(frame.seq, int) or frame.seq < 0:
            self._drop("bad_seq", f"worker={wid} seq={frame.seq!r}")
            return
        if w.first_seq is None:
            w.first_seq = frame.seq
        now = frame.recv_ts
        for step in on_live(w.tracker, frame.seq, frame, _no_replay):
            if isinstance(step, DeliverStep):
                self._apply_batch(wid, w, step.item)
            elif isinstance(step, GapStep):
                res = step.resolution
                self._carry_out(reconcile.on_gap(w.stream, res.first, res.last, now, self.policy,
                                                 recovered=res.recovered), wid, f"gap {res.first}..{res.last}")
            else:
                self._carry_out(reconcile.on_restart(w.stream, now), wid,
                                f"restart (seq {step.old_seq} -> {step.new_seq})")
        w.last_seq = frame.seq

    def _carry_out(self, decision: reconcile.Decision, wid: str, where: str) -> None:
        """The offline half of a reconciliation decision: clear, count (no snapshot to ask for)."""
        if decision.clear:
            self.index.clear_worker(self.model, wid)
            log.info("worker %s: %s: cleared%s", wid, where, " (resync)" if decision.resync else "")
        if decision.drop is not None:
            self.drops[decision.drop] = self.drops.get(decision.drop, 0) + 1

    def _apply_batch(self, wid: str, w: WorkerReplay, frame: LogFrame) -> None:
        # Fast path: read only dp_rank and the event tags, and let the index decode the payload its
        # own (fastest) way. Anything the head cannot read goes through the full decoder, as live.
        head = _read_head(frame.payload)
        if head is not None:
            batch_rank, types = head.data_parallel_rank, [e.type_name for e in head.events]
            batch: KVEventBatch | None = None
        else:
            got = decode_batch(frame.payload)
            if isinstance(got, DecodeError):
                self._drop("decode_" + got.reason, f"worker={wid} seq={frame.seq}: {got.message}")
                return
            batch = got
            batch_rank, types = batch.data_parallel_rank, [type(ev).__name__ for ev in batch.events]
        dp_rank = reconcile.batch_rank(batch_rank, frame.dp_rank, self.default_dp_rank)
        now = frame.recv_ts
        if not types:
            if batch is None and isinstance(decode_batch(frame.payload), DecodeError):
                self._drop("decode_invalid", f"worker={wid} seq={frame.seq}: empty batch that does not decode")
                return
            self.heartbeats += 1
            self.batches += 1
            w.dp_ranks.add(dp_rank)
            reconcile.on_batch(w.stream, frame.seq, now, self.policy, heartbeat=True)
            return
        if batch is None:
            stats = self.index.apply_payload(self.model, wid, dp_rank, frame.payload)
            bad = reconcile.whole_batch_drop(stats.drops)
            if bad is not None:  # the head read but the full decode did not: a whole-batch drop, as live
                self._drop(bad, f"worker={wid} seq={frame.seq}: payload does not decode")
                return
        else:
            stats = self.index.apply(self.model, wid, dp_rank, batch)
        self.batches += 1
        w.dp_ranks.add(dp_rank)
        for name in types:
            self.events[name] = self.events.get(name, 0) + 1
        for (typ, medium, outcome), n in stats.counts.items():
            if n:
                key = f"{typ}/{medium}/{outcome}"
                self.blocks[key] = self.blocks.get(key, 0) + n
        for reason, n in stats.drops.items():
            if n:
                self.drops[reason] = self.drops.get(reason, 0) + n
        self._carry_out(reconcile.on_batch(w.stream, frame.seq, now, self.policy,
                                           cleared=reconcile.cleared_in(stats.counts),
                                           orphans=bool(stats.resync_needed)),
                        wid, f"seq {frame.seq}: orphans expired")

    def _drop(self, reason: str, detail: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1
        n = self._logged[reason] = self._logged.get(reason, 0) + 1
        if n <= _LOG_FIRST:
            log.warning("dropped (%s): %s", reason, detail)

    # --- queries ------------------------------------------------------------------------------
    def answer(self, q: TimedQuery) -> QueryAnswer:
        query = q.query
        model = query.model or self.model
        ans = QueryAnswer(q.line, query.id, query.t, q.at, self.frames, model)
        if model not in self.index.models():
            ans.error = f"unknown model {model!r} (this replay applies the log to {self.model!r})"
            return ans
        res = self.index.score(model, query.token_ids, lora_name=query.lora_name, cache_salt=query.cache_salt)
        ans.query_blocks = res.query_blocks
        ans.block_size = res.block_size
        ans.workers = [msgspec.structs.asdict(ws) for ws in res.workers]
        return ans

    # --- summary ------------------------------------------------------------------------------
    def summary(self, *, log_path: str, nbytes: int, truncated: bool, corrupt_frames: int, queries: int,
                elapsed_s: float) -> ReplaySummary:
        stats = self.index.worker_stats(self.model)
        per_worker: dict[str, dict[str, dict[str, int]]] = {}
        for (wid, rank), tiers in sorted(stats.items()):
            per_worker.setdefault(wid, {})[str(rank)] = dict(tiers)
        workers = [
            WorkerSummary(wid, w.frames, w.stream.batches, w.stream.heartbeats, w.stream.gaps, w.stream.missing,
                          w.stream.restarts, w.stream.resyncs, w.first_seq, w.last_seq, per_worker.get(wid, {}))
            for wid, w in sorted(self.workers.items())
        ]
        return ReplaySummary(
            log=log_path, model=self.model, block_size=self.index.models()[self.model], frames=self.frames,
            batches=self.batches, heartbeats=self.heartbeats, bytes=nbytes, truncated=truncated,
            corrupt_frames=corrupt_frames, events=dict(sorted(self.events.items())),
            blocks=dict(sorted(self.blocks.items())), drops=dict(sorted(self.drops.items())),
            gaps=sum(w.stream.gaps for w in self.workers.values()),
            restarts=sum(w.stream.restarts for w in self.workers.values()),
            resyncs=sum(w.stream.resyncs for w in self.workers.values()), queries=queries,
            elapsed_s=elapsed_s, frames_per_s=self.frames / elapsed_s if elapsed_s > 0 else 0.0,
            workers=workers,
        )


def _no_replay(first: int, last: int) -> tuple[()]:
    return ()


def replay_with_queries(
    replayer: LogReplayer,
    frames: Iterable[LogFrame],
    queries: list[TimedQuery],
    on_answer: Callable[[QueryAnswer], None],
    on_frame: Callable[[LogFrame], None] | None = None,
) -> None:
    """Apply `frames` in order, answering each query (sorted by `.at`) just before the first frame
    recorded after it; queries later than the last frame are answered at the end."""
    qi = 0
    nq = len(queries)
    for frame in frames:
        while qi < nq and queries[qi].at < frame.recv_ts:
            on_answer(replayer.answer(queries[qi]))
            qi += 1
        replayer.apply_frame(frame)
        if on_frame is not None:
            on_frame(frame)
    while qi < nq:
        on_answer(replayer.answer(queries[qi]))
        qi += 1


def shown(name: str) -> str:
    """A worker or model name as printed to a terminal: as is when printable, else with
    backslash escapes (a recorded name never carries a newline or an ANSI escape to the screen)."""
    return name if name.isprintable() else name.encode("unicode_escape").decode("ascii")


def format_summary(s: ReplaySummary) -> str:
    """The human-readable summary `kvatlas replay --apply` prints."""
    lines = [
        f"replayed {s.log}: {s.frames} frames ({s.bytes} bytes), {s.batches} batches "
        f"({s.heartbeats} heartbeats) into model {s.model!r} (block size {s.block_size})",
        f"  elapsed {s.elapsed_s:.3f}s, {s.frames_per_s:,.0f} frames/s"
        + (f", {s.queries} queries answered" if s.queries else ""),
    ]
    if s.truncated:
        lines.append("  WARNING: the log ends in a truncated frame; everything before it was applied")
    if s.corrupt_frames:
        lines.append(f"  WARNING: {s.corrupt_frames} corrupt frame(s) skipped")
    lines.append("  events: " + (", ".join(f"{k} {v}" for k, v in s.events.items()) or "none"))
    if s.blocks:
        lines.append("  blocks: " + ", ".join(f"{k} {v}" for k, v in s.blocks.items()))
    lines.append("  drops: " + (", ".join(f"{k} {v}" for k, v in s.drops.items()) or "none"))
    lines.append(f"  gaps {s.gaps}, restarts {s.restarts}, resyncs {s.resyncs}")
    for w in s.workers:
        seqs = "no frames" if w.first_seq is None else f"seq {w.first_seq}..{w.last_seq}"
        lines.append(f"  worker {shown(w.worker_id)}: {w.frames} frames, {seqs}, gaps {w.gaps} "
                     f"({w.missing_seqs} seqs missing), restarts {w.restarts}, resyncs {w.resyncs}")
        for rank, tiers in w.blocks.items():
            lines.append(f"    dp_rank {rank}: " + " ".join(f"{k}={v}" for k, v in tiers.items()))
    return "\n".join(lines)


# --- scanning and re-publishing ---------------------------------------------------------------------

def infer_block_size(frames: Iterable[LogFrame], max_frames: int = 100_000) -> int | None:
    """Block size of the first self-describing store (block_size > 0) within `max_frames` frames."""
    for i, frame in enumerate(frames):
        if i >= max_frames:
            break
        batch = decode_batch(frame.payload)
        if isinstance(batch, DecodeError):
            continue
        for ev in batch.events:
            if isinstance(ev, BlockStored) and isinstance(ev.block_size, int) and ev.block_size > 0:
                return ev.block_size
    return None


def frame_nbytes(frame: LogFrame) -> int:
    """Bytes the frame occupies in the log (length prefix + msgpack body), computed without
    re-encoding — the progress bar's position in the file."""
    worker = len(frame.worker.encode("utf-8"))
    payload = len(frame.payload)
    return 4 + 1 + 9 + _str_size(worker) + _int_size(frame.dp_rank) + _int_size(frame.seq) + _bin_size(payload)


def _str_size(n: int) -> int:
    return n + (1 if n < 32 else 2 if n < 256 else 3 if n < 65536 else 5)


def _bin_size(n: int) -> int:
    return n + (2 if n < 256 else 3 if n < 65536 else 5)


def _int_size(v: int | None) -> int:
    if v is None:
        return 1
    if v >= 0:
        return 1 if v < 128 else 2 if v < 256 else 3 if v < 65536 else 5 if v < (1 << 32) else 9
    return 1 if v >= -32 else 2 if v >= -128 else 3 if v >= -32768 else 5 if v >= -(1 << 31) else 9


class PublishPlan(msgspec.Struct):
    worker_id: str
    endpoint: str
    replay_endpoint: Union[str, None]


def plan_publishers(
    workers: list[str],
    endpoints: list[tuple[str | None, str]],
    replay_endpoints: list[tuple[str | None, str]],
    base_port: int | None = None,
    replay_base_port: int | None = None,
    host: str = "127.0.0.1",
) -> list[PublishPlan]:
    """One publisher per recorded worker (sorted by id). Endpoints come from `W=ENDPOINT` pairs (a
    bare ENDPOINT, worker None, only when the log has one worker) or from `base_port + i` in worker
    order. Raises ValueError with a message for an inconsistent assignment."""
    workers = sorted(workers)
    if not workers:
        raise ValueError("the log has no frames: nothing to publish")

    def assign(pairs: list[tuple[str | None, str]], base: int | None, what: str, base_flag: str) -> dict[str, str]:
        out: dict[str, str] = {}
        if pairs and base is not None:
            raise ValueError(f"give either --{what} or --{base_flag}, not both")
        if base is not None:
            if not 0 < base or base + len(workers) - 1 > 65535:
                raise ValueError(f"--{base_flag} {base}: ports {base}..{base + len(workers) - 1} "
                                 f"are not all valid")
            return {w: f"tcp://{host}:{base + i}" for i, w in enumerate(workers)}
        for wid, ep in pairs:
            if wid is None:
                if len(workers) != 1:
                    raise ValueError(f"the log has {len(workers)} workers ({', '.join(workers)}): "
                                     f"use --{what} W=ENDPOINT per worker or --{base_flag}")
                wid = workers[0]
            if wid not in workers:
                raise ValueError(f"--{what} names worker {wid!r}, which is not in the log "
                                 f"(workers: {', '.join(workers)})")
            if wid in out:
                raise ValueError(f"--{what} gives worker {wid!r} twice")
            out[wid] = ep
        return out

    pubs = assign(endpoints, base_port, "publish", "publish-base-port")
    missing = [w for w in workers if w not in pubs]
    if missing:
        raise ValueError(f"no publish endpoint for worker(s) {', '.join(missing)}")
    reps = assign(replay_endpoints, replay_base_port, "replay-endpoint", "replay-base-port")
    return [PublishPlan(w, pubs[w], reps.get(w)) for w in workers]


class RepublishStep:
    """What the shell does with one frame when re-publishing: restart that worker's publisher first
    (its recorded seq went back), then send the payload. `gap` is the recorded seqs lost before it."""

    __slots__ = ("frame", "restart", "gap")

    def __init__(self, frame: LogFrame, restart: bool, gap: tuple[int, int] | None) -> None:
        self.frame = frame
        self.restart = restart
        self.gap = gap


def republish_steps(frames: Iterable[LogFrame]) -> Iterator[RepublishStep]:
    """Classify frames per worker for re-publishing: seq going back = the recorded publisher
    restarted (so should ours); a seq jump = a gap in the recording."""
    last: dict[str, int] = {}
    for frame in frames:
        prev = last.get(frame.worker)
        restart = prev is not None and frame.seq <= prev
        gap = None
        if prev is not None and not restart and frame.seq > prev + 1:
            gap = (prev + 1, frame.seq - 1)
        last[frame.worker] = frame.seq
        yield RepublishStep(frame, restart, gap)


def pace_delay(first_ts: float, frame_ts: float, elapsed: float, speed: float) -> float:
    """Seconds to wait before sending a frame recorded at `frame_ts` when `elapsed` seconds have
    passed since the first frame was sent; 0 for `speed == 0` (as fast as possible) and for
    timestamps that are not finite."""
    if speed <= 0:
        return 0.0
    delay = (frame_ts - first_ts) / speed - elapsed
    return delay if delay > 0.0 and math.isfinite(delay) else 0.0


MAX_PACE_GAP_S = 3600.0


class Pacer:
    """Recorded time for `--speed` pacing, robust to absurd timestamps: a recv_ts that is not
    finite, or jumps more than `max_gap_s` from the frame before (1e18 ahead, a first frame at
    -1e18), does not advance the pace: the jump counts as zero and is counted in `clamped`.
    Small steps back (workers interleaved) wait for nothing, as with absolute pacing."""

    __slots__ = ("speed", "max_gap_s", "clamped", "_offset", "_prev")

    def __init__(self, speed: float, max_gap_s: float = MAX_PACE_GAP_S) -> None:
        self.speed = speed
        self.max_gap_s = max_gap_s
        self.clamped = 0
        self._offset = 0.0  # recorded seconds since the first frame, jumps collapsed
        self._prev: float | None = None  # latest recorded ts the offset is measured from

    def delay(self, frame_ts: float, elapsed: float) -> float:
        """Seconds to wait before sending this frame, `elapsed` seconds after the first was sent."""
        if not math.isfinite(frame_ts):
            self.clamped += 1
        elif self._prev is None:
            self._prev = frame_ts
        else:
            step = frame_ts - self._prev
            if abs(step) > self.max_gap_s:
                self.clamped += 1
                self._prev = frame_ts  # a new baseline: later frames are paced from here
            elif step > 0:
                self._offset += step
                self._prev = frame_ts
        if self.speed <= 0:
            return 0.0
        return pace_delay(0.0, self._offset, elapsed, self.speed)
