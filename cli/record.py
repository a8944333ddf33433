"""`kvatlas record`: record live publishers into an event log until stopped.

    kvatlas record --connect w0=tcp://10.0.0.5:5557 --replay w0=tcp://10.0.0.5:5558 --out run.kvlog

SIGINT/SIGTERM (or `--duration`) stop it cleanly: the log is flushed and closed, exit code 0.
Frames are recorded as delivered by the subscriber (replayed batches included, in seq order), with
the payload bytes exactly as received. Gaps that replay could not fill show up in the log as seq
jumps; a publisher restart as seq going back — readers see the same story the live indexer saw.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from types import FrameType

import msgspec

log = logging.getLogger("kvatlas.record")


class _BatchHead(msgspec.Struct, array_like=True):
    """Just enough of a batch to read its dp_rank without decoding the events."""

    ts: float
    events: msgspec.Raw
    data_parallel_rank: int | None = None


_head_decoder = msgspec.msgpack.Decoder(_BatchHead)


def dp_rank_of(payload: bytes) -> int | None:
    """The batch's dp_rank, or None when absent or the payload is malformed (recorded anyway)."""
    try:
        return _head_decoder.decode(payload).data_parallel_rank
    except msgspec.MsgspecError:
        return None


def parse_assignment(text: str, flag: str) -> tuple[str, str]:
    worker, sep, endpoint = text.partition("=")
    if not sep or not worker or "://" not in endpoint:
        raise argparse.ArgumentTypeError(f"{flag} expects ID=tcp://HOST:PORT, got {text!r}")
    return worker, endpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connect", action="append", required=True, metavar="ID=ENDPOINT",
                        type=lambda s: parse_assignment(s, "--connect"),
                        help="publisher to record (repeatable), e.g. w0=tcp://127.0.0.1:5557")
    parser.add_argument("--replay", action="append", default=[], metavar="ID=ENDPOINT",
                        type=lambda s: parse_assignment(s, "--replay"),
                        help="replay endpoint of a publisher, used to fill gaps (repeatable)")
    parser.add_argument("--out", required=True, help="event log file to write")
    parser.add_argument("--duration", type=float, default=None, metavar="S",
                        help="stop after S seconds (default: until SIGINT/SIGTERM)")
    parser.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    parser.add_argument("--replay-timeout", type=float, default=2.0, metavar="S",
                        help="seconds of replay-socket silence before a gap counts as lost")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def run(args: argparse.Namespace) -> int:
    from indexer.eventlog import EventLogWriter
    from indexer.deliveries import Batch, Gap, Restart
    from indexer.subscriber import Subscriber

    connects = dict(args.connect)
    if len(connects) != len(args.connect):
        print("kvatlas record: a worker ID is given twice in --connect", file=sys.stderr)
        return 2
    replays = dict(args.replay)
    unknown = sorted(set(replays) - set(connects))
    if unknown:
        print(f"kvatlas record: --replay for unknown worker(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    if args.duration is not None and args.duration <= 0:
        print("kvatlas record: --duration must be > 0", file=sys.stderr)
        return 2

    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    sub = Subscriber(replay_timeout=args.replay_timeout)
    try:
        writer = EventLogWriter(args.out)
    except OSError as exc:
        print(f"kvatlas record: cannot write {args.out}: {exc}", file=sys.stderr)
        sub.close()
        return 2
    batches = gaps = lost = restarts = 0
    progress = not args.no_progress
    tty = sys.stderr.isatty()
    try:
        for wid, endpoint in connects.items():
            sub.add(wid, endpoint, replays.get(wid), topic=args.topic)
        log.info("recording %d publisher(s) into %s", len(connects), args.out)
        start = time.monotonic()
        deadline = None if args.duration is None else start + args.duration
        next_progress = start + 1.0
        while not stop.is_set():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            wait_ms = 200 if deadline is None else max(1, min(200, int((deadline - now) * 1000)))
            deliveries = sub.poll(wait_ms)
            for d in deliveries:
                if isinstance(d, Batch):
                    writer.write(d.recv_ts, d.worker_id, dp_rank_of(d.payload), d.seq, d.payload)
                    batches += 1
                elif isinstance(d, Gap):
                    gaps += 1
                    lost += 0 if d.recovered else 1
                elif isinstance(d, Restart):
                    restarts += 1
            if deliveries:
                writer.flush()  # a log being written can be read (and tailed) while recording
            if progress and time.monotonic() >= next_progress:
                next_progress += 1.0
                _progress(tty, batches, writer.bytes_written, gaps, lost, restarts, time.monotonic() - start)
    except ValueError as exc:
        print(f"kvatlas record: {exc}", file=sys.stderr)
        return 2
    finally:
        writer.close()
        sub.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)
    if progress and tty:
        sys.stderr.write("\n")
    print(f"recorded {batches} batches ({writer.bytes_written} bytes) to {args.out}; "
          f"gaps {gaps} (unrecovered {lost}), restarts {restarts}", file=sys.stderr)
    return 0


def _progress(tty: bool, batches: int, nbytes: int, gaps: int, lost: int, restarts: int, secs: float) -> None:
    line = (f"recording: {batches} batches, {nbytes / 1e6:.1f} MB, gaps {gaps} (lost {lost}), "
            f"restarts {restarts}, {secs:.0f}s")
    sys.stderr.write(("\r" + line) if tty else (line + "\n"))
    sys.stderr.flush()
