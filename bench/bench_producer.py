"""Producer cache throughput: insert/s and match_prefix/s at page size 16 and 1, with events off
and on, and the on/off ratio — the cost of being observable. Both variants run in the same
process, interleaved, on the same request stream; best of N rounds.

Events "on" means the full path an engine pays: SHA-256 page chain, event structs with coalescing,
and a msgpack-encoded batch per step (handed to a sink that drops it, so no socket is measured).

    .venv/bin/python bench/bench_producer.py [--requests 2000] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from producer.driver import StreamSpec, build_cache, synthetic_stream  # noqa: E402
from producer.events import EventRecorder  # noqa: E402
from producer.sinks import _PayloadSink  # noqa: E402


class DropSink(_PayloadSink):
    """Encodes like a real sink, then drops the payload."""

    __slots__ = ("bytes",)

    def __init__(self) -> None:
        self.bytes = 0

    def send_payload(self, payload: bytes) -> None:
        self.bytes += len(payload)

    def close(self) -> None:
        pass


def run_once(requests: list[list[int]], page_size: int, page_hash: str | None, device_pages: int) -> tuple[float, float]:
    """Returns (inserts/s, matches/s). Device-only cache under eviction pressure.
    `page_hash` None = events off; else events on with that page-hash chain."""
    rec = EventRecorder(DropSink(), enabled=page_hash is not None, heartbeat_interval_s=3600.0)
    cache = build_cache(page_size=page_size, device_pages=device_pages, recorder=rec, page_shape=(1,),
                        page_hash=page_hash or "sha256")
    t_insert = t_match = 0.0
    clock = time.perf_counter
    for tokens in requests:
        t0 = clock()
        m = cache.match_prefix(tokens)
        t1 = clock()
        need = len(tokens) // page_size - len(m.device_pages)
        cache.lock(m.device_node)
        pages = cache.alloc_device(need)  # allocation + eviction: part of inserting new KV
        cache.unlock(m.device_node)
        cache.insert(tokens, m.device_pages + pages)
        cache.step(0.0)                   # flush: event encoding happens here
        t2 = clock()
        t_match += t1 - t0
        t_insert += t2 - t1
    n = len(requests)
    return n / t_insert, n / t_match


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    spec = StreamSpec(requests=args.requests, prefixes=32, prefix_tokens=1024, suffix_tokens=256, seed=1)
    requests = list(synthetic_stream(spec))
    print(f"{len(requests)} requests, ~{sum(map(len, requests)) // len(requests)} tokens each, "
          f"{spec.prefixes} shared prefixes; best of {args.rounds} rounds\n")
    print(f"{'page':>4} {'events':>10} {'insert/s':>10} {'match/s':>10}")
    variants = {"off": None, "on sha256": "sha256", "on xxh3": "xxh3"}
    worst: dict[str, float] = {}
    for page_size in (16, 1):
        device_pages = 16384 // page_size  # 16k tokens: eviction runs all the time
        best = {v: (0.0, 0.0) for v in variants}
        for _ in range(args.rounds):
            for name, page_hash in variants.items():
                ins, mat = run_once(requests, page_size, page_hash, device_pages)
                b = best[name]
                best[name] = (max(b[0], ins), max(b[1], mat))
        for name in variants:
            ins, mat = best[name]
            print(f"{page_size:>4} {name:>10} {ins:>10.0f} {mat:>10.0f}")
        for name in ("on sha256", "on xxh3"):
            ratio_i = best[name][0] / best["off"][0]
            ratio_m = best[name][1] / best["off"][1]
            print(f"{page_size:>4} {name}/off insert {ratio_i:.3f} (cost {100 * (1 - ratio_i):.1f}%), "
                  f"match {ratio_m:.3f}")
            if page_size == 16:
                worst[name] = 1 - ratio_i
        print()
    for name, cost in worst.items():
        print(f"events cost at page size 16, {name.split()[1]} page hash: {100 * cost:.1f}% of insert "
              f"throughput (target <= 10%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
