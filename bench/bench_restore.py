"""Snapshot restore at fleet scale: decode + `load_dump` of one snapshot into a fresh index, the C load
(`U64Map.load`: the main tree's stores in one call, the residency table laid out once at its final
width) against the per-entry Python loop over the same accelerator maps (`dump.load_model_dump` +
`groupdump.load_groups`: what restore ran before, kept as the reference), same snapshot, same process.

    .venv/bin/python -m bench.bench_restore                       # 1M × 100 / 1k workers, 320k × 10k
    .venv/bin/python -m bench.bench_restore --points 1e7x100 --rounds 1

The snapshot is the bench_scaling.py workload without its ingest (docs/scaling.md, "The index at
scale"): documents of 32 blocks, each held by 4 random workers, every worker E / W entries on GPU,
built straight as a dump, loaded and dumped again (a real dump's order) and encoded in the service's format (indexer/snapshot.py). Times are CPU
seconds of the process (the machine is shared: read the ratio, both sides measured in the same run,
their order alternating per round). Each load is checked against the other: tier counts per worker,
node count, table width and bytes. Results: docs/scaling.md and docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from indexer.core.dump import DUMP_KIND, load_model_dump  # noqa: E402
from indexer.core.groupdump import load_groups  # noqa: E402
from indexer.index import KVIndex  # noqa: E402
from indexer.snapshot import SNAPSHOT_VERSION, ModelSnapshot, Snapshot, decode_snapshot, encode_snapshot  # noqa: E402
from schemas.events import BlockStored  # noqa: E402

MODEL, BS, DOC_BLOCKS, SHARE = "m", 16, 32, 4
DEFAULT = "1e6x100,1e6x1000,3.2e5x10000"


def snapshot(entries: int, workers: int) -> bytes:
    """The encoded snapshot of E entries over W workers (bench_scaling.py's plan, keys random u64)."""
    per_worker = max(1, entries // (workers * DOC_BLOCKS))
    docs = max(1, workers * per_worker // SHARE)
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**64, (docs, DOC_BLOCKS), dtype=np.uint64)
    out = []
    for w in range(workers):
        held = rng.choice(docs, size=per_worker, replace=False) if per_worker <= docs else np.arange(per_worker) % docs
        ks = keys[held].ravel().tolist()
        hs = [((int(d) * DOC_BLOCKS + b + 1) * 0x9E3779B97F4A7C15) & ((1 << 63) - 1) for d in held for b in range(DOC_BLOCKS)]
        out.append((f"worker-{w:05d}", 0, [BlockStored(hs, None, [], 0, medium="GPU", extra_keys=ks,
                                                        kv_cache_spec_kind=DUMP_KIND)]))
    ix = KVIndex()  # dumped again from an index: a real dump lists a worker's blocks in its map's order
    ix.load_dump(MODEL, BS, out)
    return encode_snapshot(Snapshot(SNAPSHOT_VERSION, 1, time.time(), [], [ModelSnapshot(MODEL, BS, ix.dump(MODEL))]))


def restore(data: bytes, c_load: bool) -> tuple[float, float, KVIndex]:
    """(decode CPU s, load CPU s, the index) for one restore."""
    gc.collect()
    t = time.process_time()
    ms = decode_snapshot(data).models[0]
    t_dec = time.process_time() - t
    ix = KVIndex()
    t = time.process_time()
    if c_load:
        ix.load_dump(ms.model, ms.block_size, ms.workers)
    else:  # KVIndex.load_dump as it was: the per-entry loop over the accelerator's maps
        ix.ensure_model(ms.model, ms.block_size)
        m = ix._models[ms.model]
        load_model_dump(m, ms.workers) + load_groups(m, ms.workers)
    return t_dec, time.process_time() - t, ix


def fingerprint(ix: KVIndex) -> tuple:
    nodes = ix._models[MODEL].nodes
    return ix.worker_stats(MODEL), ix.num_nodes(MODEL), nodes.width, nodes.nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", default=DEFAULT, help=f"ENTRIESxWORKERS,... (default {DEFAULT})")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per point, the order of the two alternating")
    args = ap.parse_args()
    probe = KVIndex()
    if not probe.native:
        sys.exit("the C accelerator is not built: nothing to compare (make .venv/.installed)")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d', time.gmtime())} commit {commit}: {' '.join(sys.argv)}; {os.cpu_count()} CPUs; "
          f"load average {os.getloadavg()[0]:.1f}; CPU s, median of {args.rounds}")
    print("| entries | workers | snapshot | decode | load: per-entry loop | load: C | restore (decode + load) loop / C |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.points.split(","):
        e, w = spec.split("x")
        entries, workers = int(float(e)), int(w)
        data = snapshot(entries, workers)
        times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        seen: dict[bool, tuple] = {}
        for r in range(args.rounds):
            for c_load in ((True, False) if r % 2 == 0 else (False, True)):
                t_dec, t_load, ix = restore(data, c_load)
                times[c_load].append((t_dec, t_load))
                seen.setdefault(c_load, fingerprint(ix))
                del ix
        if seen[True] != seen[False]:
            sys.exit(f"{spec}: the C load and the per-entry loop restored different state")
        dec = statistics.median(t for ts in times.values() for t, _ in ts)
        loop = statistics.median(t for _, t in times[False])
        fast = statistics.median(t for _, t in times[True])
        print(f"| {entries:,} | {workers:,} | {len(data) / 1e6:.0f} MB | {dec:.2f} s | {loop:.2f} s | {fast:.2f} s | "
              f"{dec + loop:.2f} / {dec + fast:.2f} s: **{(dec + loop) / (dec + fast):.1f}×** |", flush=True)


if __name__ == "__main__":
    main()
