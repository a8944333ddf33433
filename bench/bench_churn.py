"""Worker churn at fleet width: holder lists against dense residency words, in one process.

    .venv/bin/python -m bench.bench_churn                 # 10k workers of 32 blocks (~1 min)
    .venv/bin/python -m bench.bench_churn --workers 2000  # quicker

Both indexes are `KVIndex(native=True)`; the peer's main tree is a plain `U64Map()` (dense words as
wide as the widest value, what every main tree was before `U64Map.holders()`), so the ratio is the
storage form's alone. Workload as bench/bench_scaling.py's: documents of 32 blocks (block size 16),
each held by 4 workers, one document per worker. Reported per form: CPU seconds to ingest the
fleet, the table's bytes (`nbytes`), `remove_worker` CPU p50 / max over `--removals` workers (each
removal compacts the slots: the last slot's bits move into the freed one), a restart's CPU p50 (a
worker removed and its blocks stored again) and the table's work per removal (`U64Map.work`: slots
and words visited; tests/test_churn_at_width.py holds it to the worker's own entries), and the form
the table ends in. CPU time of this thread: the machine is shared (docs/scaling.md, "The index at scale").
"""
from __future__ import annotations

import argparse
import random
import time
from typing import Any

from indexer.index import KVIndex
from schemas.codec import encode_batch
from schemas.events import BlockStored, KVEventBatch

BS, DOC_BLOCKS, SHARE = 16, 32, 4


def fleet(workers: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    pays = []
    for _ in range(max(1, workers // SHARE)):
        toks = [rng.randrange(1, 150_000) for _ in range(DOC_BLOCKS * BS)]
        hashes = [rng.getrandbits(62) + 1 for _ in range(DOC_BLOCKS)]
        pays.append(encode_batch(KVEventBatch(0.0, [BlockStored(hashes, None, toks, BS)])))
    return pays


def run(dense: bool, workers: int, removals: int, pays: list[bytes]) -> dict[str, Any]:
    ix = KVIndex(native=True)
    if dense:
        from indexer._native import _kvnative

        ix._accel.new_nodes = _kvnative.U64Map  # the peer: dense words
    ix.ensure_model("m", BS)
    t = time.process_time()
    for w in range(workers):
        ix.apply_payload("m", f"w{w:05d}", 0, pays[(w * 7919) % len(pays)])
    ingest = time.process_time() - t
    nodes = ix._models["m"].nodes
    nbytes = nodes.nbytes
    ts, rs = [], []
    work0 = nodes.work
    for i in range(removals):
        t = time.process_time()
        ix.remove_worker("m", f"w{(i * 37) % workers:05d}")
        ts.append(time.process_time() - t)
    work = (nodes.work - work0) / removals
    for i in range(removals):  # restarts: a high slot's worker goes and comes back with its blocks
        w = workers - 1 - 3 * i
        t = time.process_time()
        ix.remove_worker("m", f"w{w:05d}")
        ix.apply_payload("m", f"w{w:05d}", 0, pays[(w * 7919) % len(pays)])
        rs.append(time.process_time() - t)
    ts.sort()
    rs.sort()
    return {"ingest_s": ingest, "nbytes": nbytes, "rm_p50_ms": ts[len(ts) // 2] * 1e3, "rm_max_ms": ts[-1] * 1e3,
            "restart_p50_ms": rs[len(rs) // 2] * 1e3, "work": work, "form": nodes.form}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=10_000)
    ap.add_argument("--removals", type=int, default=20)
    a = ap.parse_args()
    pays = fleet(a.workers)
    res = {name: run(name == "dense", a.workers, a.removals, pays) for name in ("lists", "dense")}
    print(f"# {a.workers} workers x {DOC_BLOCKS} blocks, {a.removals} removals; CPU of this thread")
    print("| form | ingest CPU s | node table | remove_worker CPU p50 / max ms | restart CPU p50 ms | table work / removal "
          "| table after |")
    print("|---|---|---|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {r['ingest_s']:.2f} | {r['nbytes'] / 2**20:.1f} MiB | {r['rm_p50_ms']:.2f} / {r['rm_max_ms']:.2f} "
              f"| {r['restart_p50_ms']:.2f} | {r['work']:.0f} | {r['form']} |")
    lst, den = res["lists"], res["dense"]
    print(f"lists / dense: ingest {lst['ingest_s'] / den['ingest_s']:.2f}x, table {lst['nbytes'] / den['nbytes']:.3f}x, "
          f"remove_worker p50 {lst['rm_p50_ms'] / den['rm_p50_ms']:.2f}x")


if __name__ == "__main__":
    main()
