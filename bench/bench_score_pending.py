"""The `/score` answer path in process when rows carry in-flight fields: the C writer with the rows'
pending columns (`IndexerService.score_answer`, router_api/score_plan.py `pending_columns`) against the
path such answers took before it (`score` builds a WorkerScoreOut per row, msgspec encodes it), in
the same run, interleaved.

    .venv/bin/python -m bench.bench_score_pending [--workers 32] [--pending 16] [--tokens 4096] [--calls 3000]

One native service (no HTTP, no ingest thread; a frozen clock, so no route expires): `--workers`
workers with block size 16, each holding a different prefix of a shared system prompt (0 to 3/4 of
the query's blocks, some on host memory); `--pending` of them have an in-flight route for the query
(POST /routes with busy_until), so their rows carry pending_blocks, pending_requests,
pending_prefill_tokens and busy_until. The query is a `--tokens`-long u32 array (the HTTP front's
octet body). Printed per answer encoding (JSON, msgpack): p50 / p90 microseconds of one answer for
  msgspec      `msgspec.encode(svc.score(...))`: the path every answer with pending rows took before;
  c            `svc.score_answer(...)`: the C writer with the pending columns;
  c, no routes the same query on a twin service without routes (the exact rows alone, for scale);
and the ratio msgspec / c of the p50s. Every variant's bytes are checked equal before timing.
Then the in-flight work both paths share, per answer (p50): the query's node keys (`RouteBook.keys`),
the sweep (`RouteBook.sweep`), and `pending_columns` (sweep, keys and the rows' pending_blocks / load /
busy_until: `PendingRoutes.run` walking each row's keys past its exact match).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]

import msgspec  # noqa: E402
import numpy as np  # noqa: E402

from indexer.index import KVIndex  # noqa: E402
from indexer.pending import PendingRoutes  # noqa: E402
from router_api.config import ServiceConfig  # noqa: E402
from router_api.service import IndexerService  # noqa: E402
from schemas.api import RegisterWorker  # noqa: E402
from schemas.codec import encode_batch  # noqa: E402
from schemas.events import BlockStored, KVEventBatch  # noqa: E402

BS = 16
MODEL = "default"


def build(workers: int, pending: int, tokens: int) -> tuple[IndexerService, IndexerService, np.ndarray]:
    prompt = np.arange(1, tokens + 1, dtype="<u4")
    blocks = tokens // BS
    step = max(1, workers // max(1, pending))
    out = []
    for routed in (True, False):
        svc = IndexerService(ServiceConfig(block_size=BS, stale_after_s=1e9, remove_after_s=2e9),
                             index=KVIndex(native=True), clock=lambda: 1000.0,
                             pending=PendingRoutes(ttl_s=60.0))
        svc.index.ensure_model(MODEL, BS)
        for i in range(workers):
            wid = f"worker-{i:02d}"
            svc.register(RegisterWorker(worker_id=wid, endpoint=f"tcp://127.0.0.1:{20000 + i}", block_size=BS))
            n = (i * 3 * blocks) // (4 * workers)
            if n:
                ev = BlockStored(block_hashes=list(range(1, n + 1)), parent_block_hash=None,
                                 token_ids=prompt[: n * BS].tolist(), block_size=BS,
                                 medium="GPU" if i % 3 else "CPU")
                svc.index.apply_payload(MODEL, wid, 0, encode_batch(KVEventBatch(0.0, [ev])))
            if routed and i % step == 0 and i // step < pending:  # every step-th worker, `pending` of them
                svc.report_route(MODEL, f"r{i}", wid, prompt.tolist(), busy_until=1000.0 + 0.137 * i)
        out.append(svc)
    return out[0], out[1], prompt


def timed(fn: Callable[[], bytes], n: int) -> list[float]:
    clock = time.perf_counter_ns
    out = []
    for _ in range(n):
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--pending", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    routed, plain, q = build(args.workers, args.pending, args.tokens)
    rows = routed.score(MODEL, q).workers
    print(f"{args.workers} workers, {sum(1 for r in rows if r.pending_requests)} with in-flight rows, "
          f"{args.tokens}-token query, block size {BS}, {args.calls} calls per variant (interleaved by 100)")
    for mp, name in ((False, "JSON"), (True, "msgpack")):
        enc = (msgspec.msgpack if mp else msgspec.json).Encoder().encode
        variants: dict[str, Callable[[], bytes]] = {
            "msgspec": lambda: enc(routed.score(MODEL, q)),
            "c": lambda: routed.score_answer(MODEL, q, None, None, mp),
            "c, no routes": lambda: plain.score_answer(MODEL, q, None, None, mp),
        }
        assert variants["msgspec"]() == variants["c"](), "the two paths disagree"
        assert variants["c, no routes"]() == enc(plain.score(MODEL, q))
        before = routed.metrics.score_answers.get("c")
        times: dict[str, list[float]] = {k: [] for k in variants}
        gc.disable()
        for _ in range(max(1, args.calls // 100)):
            for k, fn in variants.items():
                times[k] += timed(fn, 100)
        gc.enable()
        assert routed.metrics.score_answers.get("c") - before == len(times["c"]), "an answer left the C path"
        p50 = {k: statistics.median(v) for k, v in times.items()}
        for k, v in times.items():
            print(f"  {name:8s} {k:13s} p50 {p50[k]:8.1f} us   p90 {statistics.quantiles(v, n=10)[-1]:8.1f} us")
        print(f"  {name:8s} msgspec / c p50 ratio: {p50['msgspec'] / p50['c']:.2f}x")
    shared_work(routed, q, max(100, args.calls // 3))


def shared_work(svc: IndexerService, q: np.ndarray, calls: int) -> None:
    from router_api.score_plan import pending_columns

    book, index = svc.routes, svc.index
    table = index.score_table(MODEL, q, None, None, None)
    assert table is not None
    pairs = list(zip(table.worker_ids, table.ranks))
    parts: dict[str, Callable[[], object]] = {
        "node keys": lambda: book.keys(index, MODEL, BS, q, None, None),
        "sweep": lambda: book.sweep(index, svc.registry, MODEL, 1000.0),
        "pending columns": lambda: pending_columns(book, index, svc.registry, MODEL, BS, (q, None, None), 1000.0,
                                                   pairs, table.rows),
    }
    for k, fn in parts.items():
        print(f"  shared   {k:16s} p50 {statistics.median(timed(fn, calls)):8.1f} us")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
