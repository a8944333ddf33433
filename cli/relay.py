"""`kvatlas relay`: bridge ZeroMQ KV-event publishers into NATS JetStream (docs/jetstream.md).

    kvatlas relay --nats nats://127.0.0.1:4222 \\
        --worker w0=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,model=llama,block_size=16

Each `--worker` (repeatable) is read with the indexer's gap/replay/restart logic and written to
`kvatlas.events.<model>.<worker>`; the workers are registered in the shared registry bucket so
`kvatlas indexer --nats URL` replicas pick them up. SIGINT/SIGTERM (or `--duration`) stop it
cleanly after flushing to JetStream; exit code 0.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from types import FrameType

log = logging.getLogger("kvatlas.relay")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from router_api.relay import parse_worker_spec
    from schemas.jetstream import DEFAULT_KV_BUCKET, DEFAULT_STREAM, EVENTS_PREFIX

    parser.add_argument("--nats", required=True, metavar="URL", help="NATS server, e.g. nats://127.0.0.1:4222")
    parser.add_argument("--worker", action="append", required=True, type=parse_worker_spec,
                        metavar="ID=ENDPOINT[,replay=ENDPOINT][,model=NAME][,block_size=N]",
                        help="ZeroMQ publisher to relay (repeatable)")
    parser.add_argument("--stream", default=DEFAULT_STREAM, help=f"JetStream stream (default {DEFAULT_STREAM})")
    parser.add_argument("--subject-prefix", default=EVENTS_PREFIX,
                        help=f"subject prefix (default {EVENTS_PREFIX})")
    parser.add_argument("--max-age", type=float, default=24 * 3600.0, metavar="S",
                        help="stream retention by age in seconds, 0 = unlimited (default 86400)")
    parser.add_argument("--max-bytes", type=int, default=0, metavar="N",
                        help="stream retention by size in bytes, 0 = unlimited (default)")
    parser.add_argument("--storage", choices=("file", "memory"), default="file", help="stream storage")
    parser.add_argument("--registry-bucket", default=DEFAULT_KV_BUCKET,
                        help=f"NATS KV bucket of the shared worker registry (default {DEFAULT_KV_BUCKET})")
    parser.add_argument("--no-register", action="store_true", help="do not write the shared registry")
    parser.add_argument("--replay-timeout", type=float, default=2.0, metavar="S",
                        help="seconds of replay-socket silence before a gap counts as lost")
    parser.add_argument("--duration", type=float, default=None, metavar="S",
                        help="stop after S seconds (default: until SIGINT/SIGTERM)")


def run(args: argparse.Namespace) -> int:
    from transport.natsio import NatsUnavailable
    from router_api.relay import Relay
    from schemas.jetstream import StreamSettings

    if args.duration is not None and args.duration <= 0:
        print("kvatlas relay: --duration must be > 0", file=sys.stderr)
        return 2
    settings = StreamSettings(name=args.stream, prefix=args.subject_prefix, max_age_s=args.max_age,
                              max_bytes=args.max_bytes, storage=args.storage)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    # Before the relay starts (it registers the workers): a SIGTERM from then on is a clean stop.
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        relay = Relay(args.nats, args.worker, stream=settings,
                      registry_bucket=None if args.no_register else args.registry_bucket,
                      replay_timeout=args.replay_timeout)
    except (NatsUnavailable, ValueError) as exc:
        for s, h in old.items():
            signal.signal(s, h)
        print(f"kvatlas relay: {exc}", file=sys.stderr)
        return 2
    deadline = None if args.duration is None else time.monotonic() + args.duration
    log.info("event=relay_started workers=%d stream=%s", len(args.worker), settings.name)
    try:
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            relay.step(50)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        relay.close()
    log.info("event=relay_stopped forwarded=%d restarts=%d gaps_unrecovered=%d", relay.stats.forwarded,
             relay.stats.restarts, relay.stats.gaps_unrecovered)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m cli.relay ...`), same flags as `kvatlas relay`."""
    parser = argparse.ArgumentParser(prog="kvatlas relay", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
