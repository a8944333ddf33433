"""Scaling curve of the embedded index: resident (worker, block) entries × workers.

    bash bench/setup_bench_env.sh                            # creates .venv-bench (Dynamo 1.6.1)
    .venv-bench/bin/python -m bench.bench_scaling --short    # 1M × 100 / 1k workers, 320k × 10k (2-5 min)
    .venv-bench/bin/python -m bench.bench_scaling            # + 10M × 100 / 1k / 10k (--big: + 50M × 100)
    .venv/bin/python -m bench.bench_scaling --short          # kvatlas alone (no Dynamo in .venv)
Results and their reading: docs/scaling.md, "The index at scale".

Each point (entries E, workers W) runs in a fresh subprocess per engine, so resident-memory growth is
that engine's alone. Workload (deterministic, seed 0): documents of 32 blocks (block size 16, random
tokens), each held by SHARE = 4 random workers, so E entries are E / 4 index nodes; every worker holds
E / W entries, stored one document per batch (kvatlas: one msgpack `BlockStored` per batch through
`KVIndex.apply_payload`, token hashing included; Dynamo: the same documents as its JSON stored events
through `RadixTree.apply_event`, its hashes pre-computed). The payloads are built before the baseline
RSS is read and live through the run (one per document, shared by its workers).

Per point: bytes per resident entry (RSS growth over the ingest / entries), ingest blocks/s (the
apply calls only), in-process score p50 / p99 at 8k tokens (a held document's 512 tokens followed by
fresh ones; Dynamo `find_matches`, which returns the matching workers only; kvatlas `KVIndex.score`
with `holders=True`, the holders' answer (rows of the workers that hold some of the query: the same
rows as find_matches), and the full answer (a row per worker); and for kvatlas the same score as packed rows,
`KVIndex.score_table`, the index's share of an HTTP `/score`, each also as CPU time of the calling
thread, which a loaded machine does not inflate), and for kvatlas the snapshot size (the service's
format, indexer/snapshot.py) and restore time (decode + `load_dump` into a fresh index).
A point whose projected RSS (from the 1M point of the same W) exceeds `--mem-budget-gb` is skipped
and says so. Not timed tests: the machine is shared; read ratios measured in the same run.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

BS = 16
DOC_BLOCKS = 32
SHARE = 4
QUERY_TOKENS = 8192
N_QUERIES = 200
# Points as ENTRIESxWORKERS. 10k workers start at 320k entries (one document each): its ingest is
# the slowest per block (docs/scaling.md, "The index at scale").
SHORT = "1e6x100,1e6x1000,3.2e5x10000"
FULL = "1e7x100,1e7x1000,1e7x10000"
BIG = "5e7x100"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def plan(entries: int, workers: int) -> tuple[int, int, np.ndarray]:
    """(documents, documents per worker, doc index per (worker, j)): each doc held by ~SHARE workers."""
    per_worker = max(1, entries // (workers * DOC_BLOCKS))
    docs = max(1, workers * per_worker // SHARE)
    rng = np.random.default_rng(0)
    held = np.empty((workers, per_worker), dtype=np.int64)
    for w in range(workers):  # distinct docs per worker, random holders per doc
        held[w] = rng.choice(docs, size=per_worker, replace=False) if per_worker <= docs else \
            np.arange(per_worker) % docs
    return docs, per_worker, held


def doc_tokens(docs: int) -> np.ndarray:
    return np.random.default_rng(1).integers(0, 150_000, (docs, DOC_BLOCKS * BS), dtype=np.int64)


def queries(toks: np.ndarray, held: np.ndarray) -> list[list[int]]:
    rng = np.random.default_rng(2)
    out = []
    for i in range(N_QUERIES):
        d = int(held[int(rng.integers(0, held.shape[0])), 0])
        tail = rng.integers(0, 150_000, QUERY_TOKENS - toks.shape[1])
        out.append(toks[d].tolist() + tail.tolist())
    return out


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def rates(workers: int, per_worker: int, cpu: list[float]) -> dict:
    """Ingest blocks per CPU second (load-independent on a shared machine): overall, each worker's first
    batch (a new worker: its slot opens), and the later ones (steady state; None with one batch each)."""
    first, later = workers * DOC_BLOCKS, workers * (per_worker - 1) * DOC_BLOCKS
    return {"blocks_per_s": (first + later) / max(1e-9, sum(cpu)), "first_blocks_per_s": first / max(1e-9, cpu[0]),
            "later_blocks_per_s": later / max(1e-9, cpu[1]) if later else None, "ingest_cpu_s": sum(cpu)}


def child_kvatlas(entries: int, workers: int, shards: int = 1) -> dict:
    from indexer.index import KVIndex
    from indexer.sharded import ShardedIndex

    def fresh() -> KVIndex | ShardedIndex:  # the service's index with `--ingest-shards N` (N > 1)
        return KVIndex() if shards == 1 else ShardedIndex(shards)
    from indexer.snapshot import ModelSnapshot, Snapshot, SNAPSHOT_VERSION, decode_snapshot, encode_snapshot
    from schemas.codec import encode_batch
    from schemas.events import BlockStored, KVEventBatch

    docs, per_worker, held = plan(entries, workers)
    toks = doc_tokens(docs)
    payloads = []
    for d in range(docs):  # engine hashes: any u64 per block, the same for every holder (as vLLM's are)
        hashes = [(d * DOC_BLOCKS + b + 1) * 0x9E3779B97F4A7C15 & ((1 << 63) - 1) for b in range(DOC_BLOCKS)]
        payloads.append(encode_batch(KVEventBatch(0.0, [BlockStored(hashes, None, toks[d].tolist(), BS,
                                                                    medium="GPU")])))
    qs = [np.asarray(q, dtype=np.uint32) for q in queries(toks, held)]
    del toks
    names = [f"worker-{w:05d}" for w in range(workers)]
    ix = fresh()
    ix.ensure_model("m", BS)
    gc.collect()
    gc.disable()
    r0 = rss_bytes()
    cpu = [0.0, 0.0]  # CPU seconds of the applies: each worker's first batch, the later ones
    for j in range(per_worker):  # round-robin over workers, as a fleet's batches interleave
        c = time.process_time()
        for w in range(workers):
            ix.apply_payload("m", names[w], 0, payloads[held[w, j]])
        cpu[j > 0] += time.process_time() - c
    r1 = rss_bytes()
    gc.enable()
    stats = ix.worker_stats("m")
    resident = sum(sum(v.values()) for v in stats.values())
    lat, packed, cpu_obj, cpu_packed, hold, hold_packed = [], [], [], [], [], []
    for q in qs:  # the holders' answer (the compact form, what find_matches returns: matching workers only)
        t = time.perf_counter()
        ix.score("m", q, holders=True)
        hold.append((time.perf_counter() - t) * 1e6)
        t = time.perf_counter()
        ix.score_table("m", q, holders=True)
        hold_packed.append((time.perf_counter() - t) * 1e6)
    for q in qs:  # a u32 buffer, as every /score body becomes (hashing in C included)
        t, c = time.perf_counter(), time.thread_time()
        ix.score("m", q)
        lat.append((time.perf_counter() - t) * 1e6)
        cpu_obj.append((time.thread_time() - c) * 1e6)
        t, c = time.perf_counter(), time.thread_time()  # as packed rows: the index's share of an HTTP /score
        ix.score_table("m", q)
        packed.append((time.perf_counter() - t) * 1e6)
        cpu_packed.append((time.thread_time() - c) * 1e6)
    t = time.perf_counter()
    snap = Snapshot(SNAPSHOT_VERSION, 1, time.time(), [], [ModelSnapshot("m", BS, list(ix.dump("m")))])
    data = encode_snapshot(snap)
    t_save = time.perf_counter() - t
    del snap
    nodes = ix.num_nodes("m")
    del ix
    gc.collect()
    t = time.process_time()
    back = decode_snapshot(data)
    ix2 = fresh()
    for ms in back.models:
        ix2.load_dump(ms.model, ms.block_size, ms.workers)
    t_restore = time.process_time() - t
    restored = ix2.worker_stats("m")  # per (worker, rank) and tier: the same counts as ingested
    return {"engine": "kvatlas" if shards == 1 else f"kvatlas {shards} shards", "entries": resident, "nodes": nodes, "workers": workers,
            "native": ix2.native, "bytes_per_entry": (r1 - r0) / max(1, resident), "rss_growth": r1 - r0,
            **rates(workers, per_worker, cpu), "score_p50_us": pct(lat, 50), "score_p99_us": pct(lat, 99),
            "table_p50_us": pct(packed, 50), "table_p99_us": pct(packed, 99),
            "holders_p50_us": pct(hold, 50), "holders_p99_us": pct(hold, 99),
            "holders_table_p50_us": pct(hold_packed, 50),
            # CPU of the calling thread (the whole score runs there): what a loaded machine does not inflate
            "score_cpu_p50_us": pct(cpu_obj, 50), "table_cpu_p50_us": pct(cpu_packed, 50),
            "snapshot_bytes": len(data), "snapshot_save_s": t_save, "restore_s": t_restore,
            "restored_equal": restored == stats, "peak_rss": rss_bytes()}


def child_dynamo(entries: int, workers: int) -> dict:
    from dynamo._core import RadixTree, compute_block_hash_for_seq

    docs, per_worker, held = plan(entries, workers)
    toks = doc_tokens(docs)
    events = []
    for d in range(docs):
        th = compute_block_hash_for_seq(toks[d].tolist(), BS)
        hashes = [(d * DOC_BLOCKS + b + 1) * 0x9E3779B97F4A7C15 & ((1 << 63) - 1) for b in range(DOC_BLOCKS)]
        events.append({"stored": {"parent_hash": None, "blocks": [
            {"block_hash": h, "tokens_hash": t} for h, t in zip(hashes, th)]}})
    qs = [compute_block_hash_for_seq(q, BS) for q in queries(toks, held)]  # its query hashing excluded
    del toks
    # Its JSON events built beforehand (as our payloads are): one per (worker, document).
    passes = [[json.dumps({"event_id": j, "data": events[held[w, j]], "dp_rank": 0}).encode()
               for w in range(workers)] for j in range(per_worker)]
    del events
    tree = RadixTree()
    gc.collect()
    r0 = rss_bytes()
    cpu = [0.0, 0.0]  # CPU seconds of every thread of the process (Dynamo applies on a background one)
    for j, batch in enumerate(passes):
        c = time.process_time()
        for w in range(workers):
            tree.apply_event(w, batch[w])
        tree.find_matches([0])  # its apply runs on a background thread: this waits for the queue
        cpu[j > 0] += time.process_time() - c
    r1 = rss_bytes()
    resident = workers * per_worker * DOC_BLOCKS
    lat = []
    for q in qs:
        t = time.perf_counter()
        tree.find_matches(q).scores
        lat.append((time.perf_counter() - t) * 1e6)
    return {"engine": "dynamo", "entries": resident, "workers": workers,
            "bytes_per_entry": (r1 - r0) / max(1, resident), "rss_growth": r1 - r0,
            **rates(workers, per_worker, cpu), "score_p50_us": pct(lat, 50), "score_p99_us": pct(lat, 99),
            "peak_rss": rss_bytes()}


def child_http(entries: int, workers: int, idle: int) -> None:
    """`--child http`: the indexer service on its production HTTP stack (uvicorn + the /score fast
    path, cli/indexer.py `server_settings`) over a model of `workers` registered workers and `entries`
    resident entries (the same documents as the in-process point, applied into its index), plus `idle`
    registered workers holding nothing. Prints its port, then serves until stdin closes."""
    import threading

    import uvicorn

    from cli.indexer import server_settings
    from router_api.app import create_app
    from router_api.config import ServiceConfig
    from router_api.service import IndexerService
    from schemas.api import RegisterWorker
    from schemas.codec import encode_batch
    from schemas.events import BlockStored, KVEventBatch
    sys.path.insert(0, str(ROOT / "tests"))
    from support.net import free_port

    docs, per_worker, held = plan(entries, workers)
    toks = doc_tokens(docs)
    port = free_port()
    svc = IndexerService(ServiceConfig(port=port, block_size=BS, stale_after_s=1e9, remove_after_s=2e9,
                                       max_workers=workers + idle))
    names = [f"worker-{w:05d}" for w in range(workers + idle)]
    for i, n in enumerate(names):
        svc.register(RegisterWorker(worker_id=n, endpoint=f"tcp://127.0.0.1:{20000 + i % 40000}", block_size=BS))
    for d_j in range(per_worker):
        for w in range(workers):
            d = int(held[w, d_j])
            hashes = [(d * DOC_BLOCKS + b + 1) * 0x9E3779B97F4A7C15 & ((1 << 63) - 1) for b in range(DOC_BLOCKS)]
            svc.index.apply_payload("default", names[w], 0, encode_batch(KVEventBatch(0.0, [BlockStored(
                hashes, None, toks[d].tolist(), BS, medium="GPU")])))
    resident = sum(sum(v.values()) for v in svc.index.worker_stats("default").values())
    server = uvicorn.Server(uvicorn.Config(create_app(svc), **server_settings("127.0.0.1", port)))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    print(json.dumps({"port": port, "entries": resident}), flush=True)
    sys.stdin.read()
    server.should_exit = True


def http_point(entries: int, workers: int, python: str, idle: int = 0) -> dict:
    """/score over HTTP (raw u32 body, one keep-alive connection) against `child_http`: p50 / p99 of
    the holders' answer (`?answer=holders`) and the full answer, and each answer's bytes."""
    import http.client

    p = subprocess.Popen([python, "-m", "bench.bench_scaling", "--child", "http", "--entries", str(entries),
                          "--workers", str(workers), "--idle", str(idle)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        assert p.stdout is not None
        info = json.loads(p.stdout.readline())
        docs, _, held = plan(entries, workers)
        qs = [np.asarray(q, dtype="<u4").tobytes() for q in queries(doc_tokens(docs), held)]
        conn = http.client.HTTPConnection("127.0.0.1", info["port"], timeout=60)
        out: dict = {"engine": "kvatlas http", "entries": info["entries"], "workers": workers, "idle": idle}
        for form, path in (("holders", "/score?answer=holders"), ("full", "/score?answer=full")):
            lat, size = [], []
            for rep in range(2):  # the first pass warms the connection and the plan
                for q in qs:
                    t = time.perf_counter()
                    conn.request("POST", path, q, {"Content-Type": "application/octet-stream"})
                    body = conn.getresponse().read()
                    if rep:
                        lat.append((time.perf_counter() - t) * 1e3)
                        size.append(len(body))
            out[f"{form}_p50_ms"], out[f"{form}_p99_ms"] = pct(lat, 50), pct(lat, 99)
            out[f"{form}_bytes_p50"] = pct(size, 50)
        conn.close()
        return out
    finally:
        if p.stdin:
            p.stdin.close()
        p.wait(timeout=60)


def run_point(engine: str, entries: int, workers: int, python: str, timeout_s: float, shards: int) -> dict:
    cmd = [python, "-m", "bench.bench_scaling", "--child", engine, "--entries", str(entries), "--workers", str(workers),
           "--shards", str(shards)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        return {"engine": engine, "entries": entries, "workers": workers, "error": f"over {timeout_s:.0f}s"}
    if p.returncode != 0:
        return {"engine": engine, "entries": entries, "workers": workers,
                "error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:200]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def fmt(r: dict) -> str:
    if "error" in r:
        return f"| {r['engine']} | {r['entries']:,} | {r['workers']:,} | {r['error']} |||||||||"
    snap = (f"{r['snapshot_bytes'] / 1e6:.0f} MB | {r['restore_s']:.2f} s"
            + ("" if r.get("restored_equal", True) else " (MISMATCH)")) if "snapshot_bytes" in r else "– | –"
    nodes = f"{r['nodes']:,}" if "nodes" in r else "–"
    table = f"{r['table_p50_us']:.0f} / {r['table_p99_us']:.0f}" if "table_p50_us" in r else "–"
    cpu = f"{r['score_cpu_p50_us']:.0f} / {r['table_cpu_p50_us']:.0f}" if "score_cpu_p50_us" in r else "–"
    hold = (f"{r['holders_p50_us']:.0f} / {r['holders_p99_us']:.0f} / {r['holders_table_p50_us']:.0f}"
            if "holders_p50_us" in r else "–")
    later = "–" if r["later_blocks_per_s"] is None else f"{r['later_blocks_per_s'] / 1e6:.3f} M"
    return (f"| {r['engine']} | {r['entries']:,} | {r['workers']:,} | {nodes} | {r['bytes_per_entry']:.1f} | "
            f"{r['rss_growth'] / 2**30:.2f} GiB | {r['first_blocks_per_s'] / 1e6:.3f} M / {later} | "
            f"{r['score_p50_us']:.0f} / {r['score_p99_us']:.0f} | {hold} | {table} | {cpu} | {snap} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--short", action="store_true", help=f"only {SHORT} (a few minutes)")
    ap.add_argument("--big", action="store_true", help=f"add {BIG} (those that fit the budgets)")
    ap.add_argument("--points", help=f"ENTRIESxWORKERS,... (default {SHORT},{FULL})")
    ap.add_argument("--mem-budget-gb", type=float, default=12.0,
                    help="skip a point whose projected RSS exceeds this (default 12 GiB: half of a 24 GiB box)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per point and engine")
    ap.add_argument("--no-dynamo", action="store_true")
    ap.add_argument("--shards", type=int, default=1,
                    help="kvatlas as a ShardedIndex of N worker shards (the service's --ingest-shards N; applied "
                         "from one thread here: memory, scores and restore, not parallel ingest)")
    ap.add_argument("--http", metavar="ENTRIESxWORKERS",
                    help="instead: /score over HTTP on the production stack at these points (e.g. 1e6x10000)")
    ap.add_argument("--child", choices=("kvatlas", "dynamo", "http"))
    ap.add_argument("--entries", type=int)
    ap.add_argument("--workers", type=int)
    ap.add_argument("--idle", type=int, default=0, help="(--http) more registered workers holding nothing")
    args = ap.parse_args()
    if args.child == "http":
        child_http(args.entries, args.workers, args.idle)
        return
    if args.http:
        for spec in args.http.split(","):
            e, w = spec.split("x")
            for idle in (0, 1000):
                r = http_point(int(float(e)), int(w), sys.executable, idle)
                print(f"HTTP /score 8k at {r['entries']:,} entries x {w} workers (+{idle} idle): holders' answer "
                      f"p50 / p99 {r['holders_p50_ms']:.2f} / {r['holders_p99_ms']:.2f} ms, "
                      f"{r['holders_bytes_p50']:.0f} B; full answer {r['full_p50_ms']:.2f} / {r['full_p99_ms']:.2f} ms, "
                      f"{r['full_bytes_p50']:.0f} B", flush=True)
        return
    if args.child:
        res = (child_kvatlas(args.entries, args.workers, args.shards) if args.child == "kvatlas"
               else child_dynamo(args.entries, args.workers))
        print(json.dumps(res))
        return
    engines = ["kvatlas"]
    if not args.no_dynamo:
        try:
            import dynamo._core  # noqa: F401
            engines.append("dynamo")
        except ImportError as exc:
            print(f"dynamo: not measured ({exc}); run bench/setup_bench_env.sh and use .venv-bench/bin/python")
    spec = args.points or (SHORT if args.short else f"{SHORT},{FULL}" + (f",{BIG}" if args.big else ""))
    points = [(int(float(e)), int(w)) for e, w in (p.split("x") for p in spec.split(","))]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d', time.gmtime())} commit {commit}: {' '.join(sys.argv)}; "
          f"{os.cpu_count()} CPUs; docs of {DOC_BLOCKS} blocks, each on {SHARE} workers; queries {QUERY_TOKENS} tokens")
    print("| engine | entries | workers | nodes | B/entry | RSS growth | ingest blocks/CPU-s: first batch per "
          "worker / later | score p50 / p99 µs (kvatlas: full answer) | holders' answer p50 / p99 µs, packed p50 | "
          "packed rows p50 / p99 µs | CPU p50 µs: score / packed | snapshot | restore CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    seen: dict[tuple[str, int], dict] = {}  # the first measured point per (engine, workers): projections
    results = []
    for e, w in points:
        for eng in engines:
            r = seen.get((eng, w))
            gib = 0.0 if r is None else r["peak_rss"] / r["entries"] * e / 2**30
            secs = 0.0 if r is None else e * (1 / r["blocks_per_s"] + r.get("restore_s", 0) / r["entries"])
            if gib > args.mem_budget_gb or secs > args.timeout:
                r = {"engine": eng, "entries": e, "workers": w,
                     "error": f"skipped: projected {gib:.1f} GiB, {secs:.0f} s (budgets {args.mem_budget_gb:g} GiB, "
                              f"{args.timeout:.0f} s)"}
            else:
                r = run_point(eng, e, w, sys.executable, args.timeout, args.shards)
                if "error" not in r:
                    seen.setdefault((eng, w), r)
            results.append(r)
            print(fmt(r), flush=True)
    pairs = {(r["entries"], r["workers"]): r for r in results if r["engine"].startswith("kvatlas") and "error" not in r}
    for r in results:
        k = pairs.get((r["entries"], r["workers"]))
        if r["engine"] == "dynamo" and "error" not in r and k:
            print(f"kvatlas / dynamo at {r['entries']:,} × {r['workers']:,}: B/entry "
                  f"{k['bytes_per_entry'] / r['bytes_per_entry']:.2f}x, ingest (blocks/CPU-s) "
                  f"{k['blocks_per_s'] / r['blocks_per_s']:.2f}x, "
                  f"score p50: holders' answer {k['holders_p50_us'] / r['score_p50_us']:.2f}x "
                  f"(packed {k['holders_table_p50_us'] / r['score_p50_us']:.2f}x), "
                  f"full answer {k['score_p50_us'] / r['score_p50_us']:.2f}x "
                  f"(packed {k['table_p50_us'] / r['score_p50_us']:.2f}x)")


if __name__ == "__main__":
    main()
