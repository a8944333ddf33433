"""The C apply alone, in process: the `bench_service.py` stream and its backlog applied through
`KVIndex.apply_run` (runs of 16 batches, workers interleaved, as the ingest thread does) — no ZeroMQ,
no threads. The tool to A/B a change to the index tables (docs/service.md, "Where the apply's time
goes now"): build each variant of `indexer/_native/kvnative.c` to its own .so (e.g. with
`-DGROW_DIV=1`) and point `KVATLAS_NATIVE_PATH` at it, alternating runs. Absolute figures only; the
peer comparison for the index core is `bench_index.py` (Dynamo's RadixTree in the same run).

`--shards N` measures the design in docs/service.md ("Ingest shards"): the workers split over N
`KVIndex` shards (worker w to shard w % N), each shard's runs applied by its own thread at the same
time (`apply_run` drops the GIL; shards share no table), against one index and one thread in the
same run, reps interleaved; it prints the ratio sharded / one.

  .venv/bin/python -m bench.bench_apply [--workers 32] [--batches 500] [--reps 3] [--shards N]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from bench.support.service_stream import BS, Stream  # noqa: E402
from indexer.index import KVIndex  # noqa: E402

RUN = 16  # batches per apply_run call


def apply_stream(idx: KVIndex, st: Stream, workers: Sequence[int] | None = None) -> float:
    """Seconds to apply `st` (or its `workers`' part), RUN batches of a worker at a time, round the fleet."""
    ws = range(len(st.payloads)) if workers is None else workers
    pos = [0] * len(st.payloads)
    t0 = time.perf_counter()
    left = True
    while left:
        left = False
        for w in ws:
            pl = st.payloads[w]
            if pos[w] < len(pl):
                k, _, _ = idx.apply_run("m", f"w{w}", 0, 0, pl[pos[w]:pos[w] + RUN])
                if k == 0:  # not the common case (or the worker's first batch): one by one
                    idx.apply_payload("m", f"w{w}", 0, pl[pos[w]], rank_from_batch=True)
                    k = 1
                pos[w] += k
                left = True
    return time.perf_counter() - t0


def apply_sharded(shards: list[KVIndex], st: Stream) -> float:
    """Seconds to apply `st` with worker w's batches on shards[w % N], one thread per shard."""
    n = len(shards)
    threads = [threading.Thread(target=apply_stream, args=(shards[i], st, range(i, len(st.payloads), n)))
               for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def sharded_vs_one(streams: list[Stream], n: int, reps: int) -> None:
    """One index and one thread against n shards on n threads, reps interleaved (order alternating)."""
    rates: dict[str, list[list[float]]] = {"one": [[], []], "sharded": [[], []]}

    def fresh(k: int) -> list[KVIndex]:
        out = [KVIndex() for _ in range(k)]
        for idx in out:
            idx.ensure_model("m", BS)
        return out

    for rep in range(reps):
        for kind in (("one", "sharded") if rep % 2 == 0 else ("sharded", "one")):
            shards = fresh(1 if kind == "one" else n)
            for i, st in enumerate(streams):
                secs = apply_stream(shards[0], st) if kind == "one" else apply_sharded(shards, st)
                rates[kind][i].append(st.blocks / secs)
    for i, name in enumerate(("stream (from empty)", "backlog (on top)")):
        one, sh = statistics.median(rates["one"][i]), statistics.median(rates["sharded"][i])
        print(f"{name:>20}: one index {one / 1e6:.2f}M blocks/s, {n} shards on {n} threads "
              f"{sh / 1e6:.2f}M, ratio {sh / one:.2f}   (medians of {reps})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--batches", type=int, default=500)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shards", type=int, default=0,
                    help="also apply over this many worker-sharded indexes on as many threads (>= 2)")
    args = ap.parse_args()
    if args.shards == 1 or args.shards < 0:
        ap.error("--shards must be 2 or more")
    streams = [Stream(args.workers, args.batches, seed=0), Stream(args.workers, args.batches, seed=2)]
    rates: list[list[float]] = [[], []]
    per_block = []
    for _ in range(args.reps):
        idx = KVIndex()
        if not idx.native:
            print("the C accelerator is not built: nothing to measure", file=sys.stderr)
            return 1
        idx.ensure_model("m", BS)
        for i, st in enumerate(streams):
            rates[i].append(st.blocks / apply_stream(idx, st))
            if i == 0:
                m = idx._models["m"]
                per_block.append((m.nodes.nbytes + sum(w.ext.nbytes for w in m.by_id.values())) / st.blocks)
    for i, name in enumerate(("stream (from empty)", "backlog (on top)")):
        print(f"{name:>20}: {streams[i].blocks} blocks, median {statistics.median(rates[i]) / 1e6:.2f}M blocks/s"
              f"   runs {', '.join(f'{r / 1e6:.2f}' for r in rates[i])}")
    print(f"{'table bytes/block':>20}: {per_block[0]:.1f} after the stream")
    if args.shards:
        sharded_vs_one(streams, args.shards, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
