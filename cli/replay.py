"""`kvatlas replay`: apply a recorded event log to an in-process index, or re-publish it over ZMQ.

    kvatlas replay run.kvlog --apply [--model M] [--block-size N] [--queries q.jsonl] [--answers a.jsonl] [--out summary.json]
    kvatlas replay run.kvlog --publish tcp://127.0.0.1:5557 [--replay-endpoint tcp://127.0.0.1:5558] [--speed 1.0]
    kvatlas replay run.kvlog --publish-base-port 5600 [--replay-base-port 5700] [--speed 0]

The decisions live in `indexer.replay` (pure); this module opens files, measures time, paces,
owns the publishers and draws the progress bar. Exit code 2 for bad input, with a message.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import IO, Any

log = logging.getLogger("kvatlas.replay")

_PROG = "kvatlas replay"


def _assignment(text: str) -> tuple[str | None, str]:
    """`W=ENDPOINT` or a bare `ENDPOINT` (worker None)."""
    if "=" in text.split("://", 1)[0]:
        worker, _, endpoint = text.partition("=")
        if not worker:
            raise argparse.ArgumentTypeError(f"expected W=ENDPOINT or ENDPOINT, got {text!r}")
    else:
        worker, endpoint = None, text
    if "://" not in endpoint:
        raise argparse.ArgumentTypeError(f"expected an endpoint like tcp://127.0.0.1:5557, got {text!r}")
    return worker, endpoint


def _non_negative(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v >= 0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", help="event log written by `kvatlas record` (or the producer)")
    mode = parser.add_argument_group("mode (one of)")
    mode.add_argument("--apply", action="store_true", help="apply the log to an in-process index")
    mode.add_argument("--publish", action="append", default=[], metavar="[W=]ENDPOINT", type=_assignment,
                      help="re-publish worker W's batches on a PUB bound here (repeatable; a bare "
                           "endpoint when the log has one worker)")
    mode.add_argument("--publish-base-port", type=int, metavar="P",
                      help="re-publish worker i (sorted by id) on tcp://HOST:P+i")
    ap = parser.add_argument_group("--apply")
    ap.add_argument("--model", default="default", help="model namespace to apply into (default: default)")
    ap.add_argument("--block-size", type=int, metavar="N",
                    help="block size (default: from the first store in the log, else 16)")
    ap.add_argument("--dp-rank", type=int, default=0, metavar="R",
                    help="dp_rank for batches that carry none (default 0, like a default registration)")
    ap.add_argument("--queries", metavar="FILE",
                    help='JSONL {"t", "token_ids", "model"?, "lora_name"?, "cache_salt"?, "id"?}, each '
                         "answered against the index as of time t")
    ap.add_argument("--query-time", choices=("auto", "offset", "absolute"), default="auto",
                    help="t is seconds after the first frame (offset), a recv_ts (absolute), or auto: "
                         "offsets when t < 1e9")
    ap.add_argument("--answers", metavar="FILE", default="-",
                    help="where query answers go as JSONL (default stdout; the summary then goes to stderr)")
    ap.add_argument("--out", metavar="RESULT.json", help="also write the summary as JSON here")
    pp = parser.add_argument_group("--publish")
    pp.add_argument("--replay-endpoint", action="append", default=[], metavar="[W=]ENDPOINT",
                    type=_assignment, help="bind worker W's replay ROUTER here (repeatable)")
    pp.add_argument("--replay-base-port", type=int, metavar="R", help="replay ROUTER of worker i on HOST:R+i")
    pp.add_argument("--host", default="127.0.0.1", help="host for --publish-base-port/--replay-base-port")
    pp.add_argument("--speed", type=_non_negative, default=0.0, metavar="X",
                    help="0 = as fast as possible (default), 1.0 = recorded pacing, 2.0 = twice as fast")
    pp.add_argument("--max-pace-gap", type=_non_negative, default=3600.0, metavar="S",
                    help="with --speed > 0: a recorded jump of more than S seconds between frames (or a "
                         "recv_ts that is not finite) is not waited for, and counted (default 3600)")
    pp.add_argument("--topic", default="", help="topic frame to publish with (default empty)")
    pp.add_argument("--buffer-steps", type=int, metavar="N",
                    help="replay buffer per publisher (default: the worker's whole log, up to 1,000,000)")
    pp.add_argument("--start-delay", type=_non_negative, default=0.0, metavar="S",
                    help="wait S seconds after binding before the first frame (lets subscribers connect)")
    pp.add_argument("--hold", type=_non_negative, default=0.0, metavar="S",
                    help="after the last frame keep serving replays for S seconds (inf: until SIGINT/SIGTERM)")
    pp.add_argument("--heartbeat", type=_non_negative, default=0.0, metavar="S",
                    help="while holding, send an empty batch every S seconds (as an idle producer does) so "
                         "subscribers that joined late learn of the recorded batches and replay them")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--progress", action="store_true", help="progress lines even when stderr is not a TTY")


def _fail(message: str) -> int:
    print(f"{_PROG}: {message}", file=sys.stderr)
    return 2


class Progress:
    """Progress bar on stderr: frames done, position in the file, rate. Redrawn at most 5x/s."""

    __slots__ = ("total_bytes", "enabled", "tty", "start", "next_draw", "frames", "nbytes", "stream")

    def __init__(self, total_bytes: int, enabled: bool, tty: bool, stream: IO[str]) -> None:
        self.total_bytes = max(1, total_bytes)
        self.enabled = enabled
        self.tty = tty
        self.stream = stream
        self.start = time.monotonic()
        self.next_draw = self.start + 0.2
        self.frames = 0
        self.nbytes = 0

    def update(self, nbytes: int) -> None:
        self.frames += 1
        self.nbytes += nbytes
        if self.enabled and self.frames & 63 == 0:  # the clock is read every 64 frames only
            now = time.monotonic()
            if now >= self.next_draw:
                self.next_draw = now + (0.2 if self.tty else 1.0)
                self._draw(now)

    def finish(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            if self.tty:
                self.stream.write("\n")
                self.stream.flush()

    def _draw(self, now: float) -> None:
        secs = max(now - self.start, 1e-9)
        frac = min(1.0, self.nbytes / self.total_bytes)
        bar = "#" * int(frac * 24)
        line = (f"replay [{bar:<24}] {frac * 100:5.1f}%  {self.frames:,} frames  "
                f"{self.nbytes / 1e6:.1f}/{self.total_bytes / 1e6:.1f} MB  {self.frames / secs:,.0f} frames/s")
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()


def run(args: argparse.Namespace) -> int:
    from indexer.eventlog import EventLogError, read_event_log

    publish = bool(args.publish) or args.publish_base_port is not None
    if args.apply == publish:
        return _fail("choose one mode: --apply, or --publish/--publish-base-port")
    if not os.path.exists(args.log):
        return _fail(f"no such file: {args.log}")
    if os.path.isdir(args.log):
        return _fail(f"{args.log} is a directory, not an event log")
    try:
        read_event_log(args.log).close()  # checks the magic before anything else happens
    except EventLogError as exc:
        return _fail(str(exc))
    tty = sys.stderr.isatty()
    show = (tty or args.progress) and not args.quiet
    try:
        if publish:
            return _run_publish(args, show, tty)
        return _run_apply(args, show, tty)
    except KeyboardInterrupt:
        print(f"{_PROG}: interrupted", file=sys.stderr)
        return 130


# --- --apply ------------------------------------------------------------------------------------------

def _run_apply(args: argparse.Namespace, show: bool, tty: bool) -> int:
    import msgspec

    from indexer.eventlog import LogFrame, read_event_log
    from indexer.index import KVIndex
    from indexer.replay import (
        LogReplayer, QueryAnswer, QueryFileError, TimedQuery, format_summary, frame_nbytes, infer_block_size,
        parse_queries, replay_with_queries, resolve_query_times,
    )

    if args.block_size is not None and args.block_size <= 0:
        return _fail(f"--block-size must be > 0, got {args.block_size}")
    if args.dp_rank < 0:
        return _fail(f"--dp-rank must be >= 0, got {args.dp_rank}")
    if args.replay_endpoint or args.replay_base_port is not None:
        return _fail("--replay-endpoint/--replay-base-port only go with --publish")
    queries: list[TimedQuery] = []
    if args.queries is not None:
        try:
            with open(args.queries, "rb") as f:
                queries = parse_queries(f)
        except OSError as exc:
            return _fail(f"cannot read queries {args.queries}: {exc}")
        except QueryFileError as exc:
            return _fail(f"{args.queries} {exc}")
    elif args.answers != "-":
        return _fail("--answers needs --queries")
    block_size = args.block_size
    if block_size is None:
        scan = read_event_log(args.log)
        try:
            block_size = infer_block_size(scan)
        finally:
            scan.close()
        if block_size is None:
            print(f"{_PROG}: no self-describing store in the log; assuming block size 16 (see --block-size)",
                  file=sys.stderr)
            block_size = 16

    answers_to_stdout = bool(queries) and args.answers == "-"
    summary_stream = sys.stderr if answers_to_stdout else sys.stdout
    answers_file: IO[bytes] | None = None
    if queries:
        try:
            answers_file = sys.stdout.buffer if answers_to_stdout else open(args.answers, "wb")  # noqa: SIM115
        except OSError as exc:
            return _fail(f"cannot write answers {args.answers}: {exc}")

    reader = read_event_log(args.log)
    frames = iter(reader)
    first = next(frames, None)  # offsets in the query file count from the first frame's recv_ts
    if queries:
        try:
            used = resolve_query_times(queries, first.recv_ts if first is not None else None, args.query_time)
        except QueryFileError as exc:
            reader.close()
            return _fail(f"{args.queries} {exc}")
        log.info("query times read as %s", used)

    def all_frames() -> Iterator[LogFrame]:
        if first is not None:
            yield first
            yield from frames

    progress = Progress(os.path.getsize(args.log), show, tty, sys.stderr)
    encoder = msgspec.json.Encoder()
    replayer = LogReplayer(KVIndex(), args.model, block_size, default_dp_rank=args.dp_rank)

    def on_answer(ans: QueryAnswer) -> None:
        assert answers_file is not None
        answers_file.write(encoder.encode(ans) + b"\n")

    def on_frame(fr: LogFrame) -> None:
        progress.update(frame_nbytes(fr))

    t0 = time.perf_counter()
    try:
        replay_with_queries(replayer, all_frames(), queries, on_answer, on_frame=on_frame)
    finally:
        reader.close()
        if answers_file is not None:
            answers_file.flush()
            if not answers_to_stdout:
                answers_file.close()
    elapsed = time.perf_counter() - t0
    progress.finish()
    summary = replayer.summary(log_path=args.log, nbytes=8 + progress.nbytes, truncated=reader.truncated,
                               corrupt_frames=reader.corrupt_frames, queries=len(queries), elapsed_s=elapsed)
    if reader.truncated:
        print(f"{_PROG}: warning: {args.log} ends in a truncated frame after {reader.frames} complete "
              f"frames; replayed what is complete", file=sys.stderr)
    print(format_summary(summary), file=summary_stream, flush=True)
    if args.out:
        try:
            with open(args.out, "wb") as out:
                out.write(msgspec.json.format(msgspec.json.encode(summary), indent=2) + b"\n")
        except OSError as exc:
            return _fail(f"cannot write {args.out}: {exc}")
    return 0


# --- --publish ----------------------------------------------------------------------------------------

class _Scan:
    """One pass over the log before publishing: which workers, how many frames, first recv_ts."""

    __slots__ = ("frames", "per_worker", "dp_rank", "first_ts", "truncated", "corrupt")

    def __init__(self) -> None:
        self.frames = 0
        self.per_worker: dict[str, list[int]] = {}  # worker -> [frames, first seq, last seq]
        self.dp_rank: dict[str, int | None] = {}  # worker -> last recorded dp_rank (for heartbeats)
        self.first_ts: float | None = None
        self.truncated = False
        self.corrupt = 0


def _scan(path: str) -> _Scan:
    from indexer.eventlog import read_event_log

    scan = _Scan()
    reader = read_event_log(path)
    for fr in reader:
        scan.frames += 1
        if scan.first_ts is None:
            scan.first_ts = fr.recv_ts
        w = scan.per_worker.get(fr.worker)
        if w is None:
            scan.per_worker[fr.worker] = [1, fr.seq, fr.seq]
        else:
            w[0] += 1
            w[2] = fr.seq
        scan.dp_rank[fr.worker] = fr.dp_rank
    scan.truncated = reader.truncated
    scan.corrupt = reader.corrupt_frames
    return scan


def _run_publish(args: argparse.Namespace, show: bool, tty: bool) -> int:
    from indexer.eventlog import read_event_log
    from indexer.replay import Pacer, frame_nbytes, shown, plan_publishers, republish_steps
    from producer.publisher import ZmqEventPublisher

    if args.queries is not None or args.out is not None or args.block_size is not None:
        return _fail("--queries/--out/--block-size only go with --apply")
    if args.buffer_steps is not None and args.buffer_steps < 0:
        return _fail(f"--buffer-steps must be >= 0, got {args.buffer_steps}")
    scan = _scan(args.log)
    if scan.truncated:
        print(f"{_PROG}: warning: {args.log} ends in a truncated frame after {scan.frames} complete "
              f"frames; re-publishing what is complete", file=sys.stderr)
    try:
        plans = plan_publishers(list(scan.per_worker), args.publish, args.replay_endpoint,
                                args.publish_base_port, args.replay_base_port, args.host)
    except ValueError as exc:
        return _fail(str(exc))

    def make(wid: str, endpoint: str, replay: str | None) -> ZmqEventPublisher:
        n = scan.per_worker[wid][0]
        steps = args.buffer_steps if args.buffer_steps is not None else max(10_000, min(n, 1_000_000))
        # The HWM must hold a whole burst at --speed 0, or PUB drops what subscribers cannot take yet.
        return ZmqEventPublisher(endpoint, replay_endpoint=replay, topic=args.topic, buffer_steps=steps,
                                 hwm=max(100_000, n + 16))

    pubs: dict[str, ZmqEventPublisher] = {}
    try:
        for p in plans:
            pubs[p.worker_id] = make(p.worker_id, p.endpoint, p.replay_endpoint)
    except ValueError as exc:
        for pub in pubs.values():
            pub.close(1.0)
        return _fail(str(exc))

    for p in plans:
        pub = pubs[p.worker_id]
        n, first_seq, last_seq = scan.per_worker[p.worker_id]
        print(f"publishing {shown(p.worker_id)} on {pub.endpoint}"
              + (f" replay {pub.replay_endpoint}" if pub.replay_endpoint else "")
              + f" ({n} frames, recorded seq {first_seq}..{last_seq})", flush=True)
        if first_seq != 0:
            print(f"{_PROG}: note: {shown(p.worker_id)}'s recording starts at seq {first_seq}; re-published seqs "
                  f"start at 0", file=sys.stderr)

    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    progress = Progress(os.path.getsize(args.log), show, tty, sys.stderr)
    sent = restarts = gaps = 0
    reader = read_event_log(args.log)
    try:
        if args.start_delay > 0:
            stop.wait(args.start_delay)
        start = time.monotonic()
        pacer = Pacer(args.speed, args.max_pace_gap)
        for step in republish_steps(reader):
            if stop.is_set():
                break
            fr = step.frame
            if fr.worker not in pubs:
                continue  # appeared after the scan (log still being written): not planned
            delay = pacer.delay(fr.recv_ts, time.monotonic() - start)
            if delay > 0 and stop.wait(delay):  # simulating recorded time, not synchronisation
                break
            if step.restart:
                # The recorded publisher restarted: so does ours, on the same addresses.
                old = pubs[fr.worker]
                old.close()
                pubs[fr.worker] = make(fr.worker, old.endpoint, old.replay_endpoint)
                restarts += 1
                print(f"{_PROG}: {shown(fr.worker)} restarted in the recording (seq back to {fr.seq}); "
                      f"restarted its publisher", file=sys.stderr)
            if step.gap is not None:
                gaps += 1
                print(f"{_PROG}: warning: {shown(fr.worker)} lost seqs {step.gap[0]}..{step.gap[1]} in the "
                      f"recording; re-published seqs close the gap", file=sys.stderr)
            pubs[fr.worker].publish_payload(fr.payload)
            sent += 1
            progress.update(frame_nbytes(fr))
        for pub in pubs.values():
            pub.flush(30)
        elapsed = time.monotonic() - start
        progress.finish()
        interrupted = stop.is_set()
        print(f"re-published {sent} of {scan.frames} frames from {len(pubs)} worker(s) in {elapsed:.3f}s "
              f"({sent / elapsed if elapsed > 0 else 0:,.0f} frames/s); restarts {restarts}, gaps {gaps}"
              + (f", timestamps not paced {pacer.clamped}" if pacer.clamped else "")
              + (" (interrupted)" if interrupted else ""), flush=True)
        if args.hold > 0 and not interrupted:
            _hold(args.hold, args.heartbeat, stop, pubs, scan.dp_rank)
    finally:
        reader.close()
        for pub in pubs.values():
            pub.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)
    return 0


def _hold(hold: float, heartbeat: float, stop: threading.Event, pubs: dict[str, Any],
          dp_ranks: dict[str, int | None]) -> None:
    """Keep the publishers (and their replay buffers) up for `hold` seconds or until a signal,
    heartbeating every `heartbeat` seconds when asked."""
    forever = math.isinf(hold)
    print(f"holding publishers open {'until SIGINT/SIGTERM' if forever else f'for {hold}s'}", flush=True)
    until = time.monotonic() + (0.0 if forever else hold)
    while True:
        left = None if forever else until - time.monotonic()
        if left is not None and left <= 0:
            return
        wait = heartbeat if heartbeat > 0 else left
        if left is not None and wait is not None:
            wait = min(wait, left)
        if stop.wait(wait):
            return
        if heartbeat > 0:
            for wid, pub in pubs.items():
                pub.heartbeat(dp_ranks.get(wid))
