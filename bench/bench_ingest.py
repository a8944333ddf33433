"""In-process drain rate of the service's ingest path (no HTTP, no peer): the figure to profile and
to A/B when changing `router_api/ingest.py`, `indexer/subscriber.py` or the C apply path.

Real ZeroMQ PUB sockets (one per worker) send the `service_stream.py` stream while the ingest loop is
not running; once ZeroMQ has queued it, `IngestLoop.step` drains it and the wall time from the first
step to the last batch applied is reported (the ingest thread's own cost per batch and per block).
The ratio printed is against the same run's baseline: the per-batch path (`--per-batch`) when
comparing, otherwise just the absolute figures.

  .venv/bin/python -m bench.bench_ingest [--workers 32] [--batches 2000] [--reps 3]
  py-spy record -o prof.svg -- .venv/bin/python -m bench.bench_ingest --reps 1
"""
from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parent.parent

from bench.support.service_stream import BS, RawPublisher, Stream, send_interleaved  # noqa: E402
from bench.support.zmtp_pub import encode  # noqa: E402
from router_api.config import ServiceConfig  # noqa: E402
from router_api.service import IndexerService  # noqa: E402
from schemas.api import RegisterWorker  # noqa: E402


def run_once(stream: Stream, ctx: zmq.Context) -> dict[str, float]:
    svc = IndexerService(ServiceConfig(block_size=BS, stale_after_s=600, remove_after_s=3600))
    loop = svc.ingest
    pubs = [RawPublisher(ctx) for _ in stream.payloads]
    for i, p in enumerate(pubs):
        svc.register(RegisterWorker(worker_id=f"w{i}", endpoint=p.endpoint, replay_endpoint=p.replay_endpoint,
                                    block_size=BS))
    sub = loop._sub = loop._subscriber_factory()
    sub.reconnect_after = 3600.0  # the queued stream waits longer than the silence that triggers a reconnect
    next_tick = time.monotonic()
    try:
        # Probe until every subscription delivers (PUB drops before the SUB has joined).
        deadline = time.monotonic() + 30
        while len({d for d in range(len(pubs)) if svc.registry.get(f"w{d}").batches}) < len(pubs):
            if time.monotonic() > deadline:
                raise TimeoutError("subscriptions")
            for p in pubs:
                if not p.sent:
                    p.pub.send(encode(b"", 0, stream.payloads[0][0]))
            next_tick = loop.step(sub, 10, next_tick)
        for p in pubs:
            p.sent.append(b"")  # seq 0 was the probe
        base = loop.applied_batches
        total = sum(map(len, stream.payloads))
        send_interleaved(pubs, stream.payloads)
        time.sleep(1.5)  # let ZeroMQ's I/O thread queue everything (a bench, not a synchronisation)
        gc.collect()
        t0 = time.perf_counter()
        while loop.applied_batches - base < total:
            for p in pubs:
                p.serve_replay()
            next_tick = loop.step(sub, 1, next_tick)
        dt = time.perf_counter() - t0
        return {"s": dt, "us_per_batch": dt * 1e6 / total, "blocks_per_s": stream.blocks / dt}
    finally:
        sub.close()
        for p in pubs:
            p.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # the probe's repeated seq 0 reads as restarts
    stream = Stream(args.workers, args.batches)
    n = sum(map(len, stream.payloads))
    print(f"stream: {args.workers} workers, {n} batches, {stream.blocks} blocks")
    ctx = zmq.Context()
    runs = [run_once(stream, ctx) for _ in range(args.reps)]
    ctx.term()
    for k in ("s", "us_per_batch", "blocks_per_s"):
        vals = [r[k] for r in runs]
        print(f"{k:>14}: median {statistics.median(vals):12,.3f}   runs {', '.join(f'{v:,.3f}' for v in vals)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
