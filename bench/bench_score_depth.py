"""Where a deep `/score` query's extra time goes, served: raw u32 bodies (msgpack answers) at 1k and
8k tokens, each as a prefix of a stored document (every block hits: the walk visits them all) and as
random tokens (the walk ends at the first block: body, hashing and the fixed cost only).
Differences of medians:
  walk  = hit 8k - miss 8k   (the probes of the deep walk; cold caches and TLB between requests)
  body  = miss 8k - miss 1k  (28 KiB more body to read, 448 more blocks to hash)
so hit 8k - hit 1k = walk 8k + body - walk 1k.

  .venv/bin/python -m bench.bench_score_depth [--queries 400] [--base /path/to/other/checkout]

`--base`: a second kvatlas service run from another source tree (built in place), fed the same
stream; requests to both alternate one by one in a fresh random order each round (an A/B on a
shared host). The stream is bench_service's (32 workers, its long documents)."""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import zmq


from bench.bench_service import chunked, connect, send_chunks, wait_visible  # noqa: E402
from bench.support.service_procs import Kvatlas  # noqa: E402
from bench.support.service_stream import Stream  # noqa: E402

SIZES = (1024, 8192)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, default=400)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--batches", type=int, default=1000)
    ap.add_argument("--base", type=Path, help="another source tree to serve from as well (A/B)")
    args = ap.parse_args()
    stream = Stream(args.workers, args.batches)
    ctx = zmq.Context()
    svcs = [Kvatlas(name="this")]
    if args.base:
        svcs.append(Kvatlas(name="base", root=args.base))
    pubs = connect(svcs[0], ctx, args.workers)
    try:
        for svc in svcs[1:]:
            connect(svc, None, args.workers, pubs)
        send_chunks(chunked(pubs, stream.payloads))
        for svc in svcs:
            wait_visible(svc, stream, pubs)
        rng = random.Random(1)
        cases = [(svc, size, hit) for svc in svcs for size in SIZES for hit in (True, False)]
        docs = {(size, hit): [stream.docs[rng.randrange(len(stream.docs))][:size] if hit
                              else [rng.randrange(1, 100_000) for _ in range(size)] for _ in range(args.queries)]
                for size in SIZES for hit in (True, False)}
        bodies = {c: [c[0].queries()["binary"][0](d) for d in docs[c[1], c[2]]] for c in cases}
        times: dict[tuple[Kvatlas, int, bool], list[float]] = {c: [] for c in cases}
        for c in cases:
            for b in bodies[c][:10]:
                c[0].queries()["binary"][1](b)  # warm-up
        order = random.Random(2)
        for i in range(args.queries):
            order.shuffle(cases)
            for c in cases:
                ask = c[0].queries()["binary"][1]
                t = time.perf_counter()
                ask(bodies[c][i])
                times[c].append(time.perf_counter() - t)
        for svc in svcs:
            p = {(s, h): statistics.median(times[svc, s, h]) * 1e6 for s in SIZES for h in (True, False)}
            print(f"{svc.name:5s} p50 µs: hit 1k {p[1024, True]:6.1f}  hit 8k {p[8192, True]:6.1f}  "
                  f"miss 1k {p[1024, False]:6.1f}  miss 8k {p[8192, False]:6.1f}  | 8k-1k (hit) "
                  f"{p[8192, True] - p[1024, True]:5.1f} = walk 8k {p[8192, True] - p[8192, False]:5.1f} "
                  f"+ body {p[8192, False] - p[1024, False]:5.1f} - walk 1k {p[1024, True] - p[1024, False]:4.1f}",
                  flush=True)
    finally:
        for p in pubs:
            p.close()
        for svc in svcs:
            svc.stop()
        ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
