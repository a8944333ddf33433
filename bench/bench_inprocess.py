"""In-process ceiling: the embedded index's ops/s on a Mooncake-trace-shaped stream, 1 and 2 threads,
against Dynamo's in-process RadixTree (ai-dynamo-runtime 1.6.1) in the same run.

    bash bench/setup_bench_env.sh && .venv-bench/bin/python -m bench.bench_inprocess [--short]

Workload (bench/support/mooncake_trace.py, seed 0): a generated trace of the Mooncake trace's shape (23,608
requests, 512-token blocks, mean input ~7.6k tokens, heavy prefix sharing), replayed on 16 workers of
2,000 GPU blocks each with KV-aware routing and LRU eviction. Each request is one lookup (every
worker's prefix match for its full blocks) followed by its apply (BlockStored of the blocks the chosen
worker lacked, BlockRemoved of what that evicts). ops = lookups + applied blocks (stored + removed);
ops/s = ops / wall time of the whole replay into a fresh index (best of `--reps`).

Both engines are given what their router would hold: kvatlas gets msgpack KV event batches with the
blocks' tokens (it hashes them itself, inside the timing) and looks up pre-hashed query keys
(`score_keys`); Dynamo gets its JSON events with its per-block token hashes pre-computed (outside the
timing) and looks up pre-computed block hashes (`find_matches`). Token hashing of the lookups is
excluded on both sides (it is the same work per query for both, and 23k queries of 7.6k tokens
held in memory would take ~0.7 GB as u32, several GB as the Python lists Dynamo's hasher takes).

Threads: kvatlas 1 = one `KVIndex`; kvatlas 2 = `ShardedIndex(2)` with `router_api.locks.ShardedLock`
(the service's ingest-shards arrangement), workers split over the shards, one thread per shard
replaying its workers' requests: the apply holds its shard's lock and runs in C without the GIL
(`apply_run`), the lookup holds every shard's lock and the GIL. Dynamo 1 / 2 = one `RadixTree`
called from 1 / 2 Python threads (same worker split); its applies run on its own background thread
in both cases. Both engines are driven exactly the same way otherwise; the 2-thread lookups see
interleavings that vary from run to run (only the 1-thread answers are checked exactly: by the bench,
untimed, after the timings, and by tests/test_bench_inprocess.py).

Also printed: medians beside the best wall times, ops per process CPU-second (all threads: on a
shared machine wall time mostly measures the other tenants), and which of the calls drop the GIL
(`gil_released`: does another Python thread run while the call is in C).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]

from bench.support import mooncake_trace as mt  # noqa: E402
import numpy as np  # noqa: E402

MODEL = "m"
WORKERS = 16
CAPACITY = 2_000


class Prepared:
    """Everything the timed replays read, built once."""

    __slots__ = ("steps", "payloads", "keys", "dyn_events", "dyn_queries", "ops", "applied")

    def __init__(self, steps: list[mt.Step], payloads: list[bytes], keys: list[list[int]],
                 dyn_events: list[list[bytes]] | None, dyn_queries: list[list[int]] | None) -> None:
        self.steps, self.payloads, self.keys = steps, payloads, keys
        self.dyn_events, self.dyn_queries = dyn_events, dyn_queries
        self.applied = sum(len(s.blocks) - s.stored_from + len(s.removed) for s in steps)
        self.ops = self.applied + len(steps)


def worker_name(w: int) -> str:
    return f"w{w}"


def prepare(records: list[mt.Record], with_dynamo: bool, keep_expected: bool = False,
            capacity: int = CAPACITY) -> Prepared:
    from indexer.index import KVIndex
    from schemas.codec import encode_batch
    from schemas.events import BlockRemoved, BlockStored, KVEventBatch

    steps = mt.steps(records, WORKERS, capacity, keep_expected)
    dyn_hash: Callable[[list[int], int], list[int]] | None = None
    if with_dynamo:
        from dynamo._core import compute_block_hash_for_seq as dyn_hash
    key_of: dict[int, int] = {}  # hash id -> kvatlas query key (a hash id fixes its whole prefix)
    local_of: dict[int, int] = {}  # hash id -> Dynamo's per-block token hash
    payloads, keys, dyn_events, dyn_queries = [], [], [], []
    evid = [0] * WORKERS
    hasher = KVIndex()
    hasher.ensure_model(MODEL, mt.BLOCK)
    for s in steps:
        missing = [h for h in s.blocks if h not in key_of]
        if missing:
            # keys chain over the whole prefix: hash the request's tokens as the index would
            ks = hasher.query_keys(MODEL, np.concatenate([mt.block_tokens(h) for h in s.blocks]))
            key_of.update(zip(s.blocks, ks))
        keys.append([key_of[h] for h in s.blocks])
        new = s.blocks[s.stored_from:]
        parent = mt.engine_hash(s.blocks[s.stored_from - 1]) if s.stored_from else None
        events: list[Any] = []
        if new:
            tok = [t for h in new for t in mt.block_tokens(h).tolist()]
            events.append(BlockStored([mt.engine_hash(h) for h in new], parent, tok, mt.BLOCK, medium="GPU"))
        if s.removed:
            events.append(BlockRemoved([mt.engine_hash(h) for h in s.removed], medium="GPU"))
        payloads.append(encode_batch(KVEventBatch(0.0, events)))
        if dyn_hash is not None:
            for h in s.blocks:
                if h not in local_of:
                    local_of[h] = dyn_hash(mt.block_tokens(h).tolist(), mt.BLOCK)[0]
            dyn_queries.append([local_of[h] for h in s.blocks])
            jevs = []
            if new:
                jevs.append({"stored": {"parent_hash": parent, "blocks": [
                    {"block_hash": mt.engine_hash(h), "tokens_hash": local_of[h]} for h in new]}})
            if s.removed:
                jevs.append({"removed": {"block_hashes": [mt.engine_hash(h) for h in s.removed]}})
            out = []
            for data in jevs:
                out.append(json.dumps({"event_id": evid[s.worker], "data": data, "dp_rank": 0}).encode())
                evid[s.worker] += 1
            dyn_events.append(out)
    return Prepared(steps, payloads, keys, dyn_events if with_dynamo else None, dyn_queries if with_dynamo else None)


# --- kvatlas ----------------------------------------------------------------------------------------
def _apply(ix: Any, wid: str, payload: bytes) -> None:
    k, _, extra = ix.apply_run(MODEL, wid, 0, 0, [payload])
    if k == 0 and extra is None:  # the run path declined it (pure core, orphans): one by one
        ix.apply_payload(MODEL, wid, 0, payload, rank_from_batch=True)


def new_kvatlas(threads: int) -> Any:
    from indexer.index import KVIndex
    from indexer.sharded import ShardedIndex

    ix: Any = KVIndex() if threads == 1 else ShardedIndex(threads, placement=lambda w: int(w[1:]) % threads)
    ix.ensure_model(MODEL, mt.BLOCK)
    for w in range(WORKERS):
        ix.register_worker(MODEL, worker_name(w))
    return ix


def replay_kvatlas(p: Prepared, threads: int, answers: list | None = None) -> tuple[float, Any]:
    """Seconds for the whole replay into a fresh index; `answers` (1 thread) collects each lookup's
    matched blocks per worker."""
    from router_api.locks import ShardedLock

    ix = new_kvatlas(threads)
    names = [worker_name(w) for w in range(WORKERS)]
    steps, payloads, keys = p.steps, p.payloads, p.keys
    if threads == 1:
        t0 = time.perf_counter()
        for i, s in enumerate(steps):
            res = ix.score_keys(MODEL, keys[i])
            if answers is not None:
                answers.append(res)
            _apply(ix, names[s.worker], payloads[i])
        return time.perf_counter() - t0, ix
    lock = ShardedLock(threads)
    mine = [[i for i, s in enumerate(steps) if s.worker % threads == t] for t in range(threads)]

    def run(t: int) -> None:
        shard = lock.shard(t)
        for i in mine[t]:
            with lock:
                ix.score_keys(MODEL, keys[i])
            with shard:
                _apply(ix, names[steps[i].worker], payloads[i])

    return _threaded(run, threads), ix


# --- Dynamo -----------------------------------------------------------------------------------------
def replay_dynamo(p: Prepared, threads: int, answers: list | None = None) -> tuple[float, Any]:
    from dynamo._core import RadixTree

    assert p.dyn_events is not None and p.dyn_queries is not None
    tree = RadixTree()
    steps, events, queries = p.steps, p.dyn_events, p.dyn_queries
    if threads == 1:
        t0 = time.perf_counter()
        for i, s in enumerate(steps):
            res = tree.find_matches(queries[i])
            if answers is not None:
                answers.append(res.scores)
            for e in events[i]:
                tree.apply_event(s.worker, e)
        tree.find_matches([0])  # its applies run on a background thread: this waits for its queue
        return time.perf_counter() - t0, tree
    mine = [[i for i, s in enumerate(steps) if s.worker % threads == t] for t in range(threads)]

    def run(t: int) -> None:
        for i in mine[t]:
            tree.find_matches(queries[i])
            for e in events[i]:
                tree.apply_event(steps[i].worker, e)

    dt = _threaded(run, threads, lambda: tree.find_matches([0]))
    return dt, tree


def _threaded(run: Callable[[int], None], threads: int, finish: Callable[[], Any] | None = None) -> float:
    errors: list[BaseException] = []

    def guarded(t: int) -> None:
        try:
            run(t)
        except BaseException as exc:  # surfaced below: a failed thread must not read as a fast one
            errors.append(exc)

    ths = [threading.Thread(target=guarded, args=(t,)) for t in range(threads)]
    t0 = time.perf_counter()
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    if finish is not None:
        finish()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return dt


# --- checks and the run -----------------------------------------------------------------------------
def kvatlas_matches(res: Any) -> list[int]:
    got = [0] * WORKERS
    for row in res.workers:
        got[int(row.worker_id[1:])] = row.device_blocks
    return got


def dynamo_matches(scores: Any) -> list[int]:
    got = [0] * WORKERS
    for k, v in dict(scores).items():
        w = k[0] if isinstance(k, tuple) else k
        got[int(w)] = int(v)
    return got


def dynamo_reason() -> str | None:
    try:
        from dynamo._core import RadixTree  # noqa: F401
    except Exception as exc:  # any import failure means: no Dynamo numbers, and say why
        failed = ROOT / ".venv-bench" / ".dynamo-install-failed"
        why = failed.read_text().strip() if failed.exists() else f"cannot import dynamo._core ({exc!r})"
        return why + "; run bench/setup_bench_env.sh and use .venv-bench/bin/python"
    return None


def gil_released(call: Callable[[], Any], loops: int = 1000) -> bool:
    """Whether `call` lets another Python thread run while it is inside C: a counter thread waits
    while the switch interval is 1 s (so the interpreter alone would not hand it the GIL during this
    short loop), then `call` runs `loops` times; the counter moves only if some call dropped the GIL
    long enough for the other thread to take it (a release too brief for that reads as "no")."""
    count, stop, go = [0], [False], threading.Event()

    def spin() -> None:
        go.wait()
        while not stop[0]:
            count[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        go.set()
        for _ in range(loops):
            call()
            if count[0]:  # seen: stop (taking the GIL back from the spinner costs the interval)
                break
        moved = count[0] > 0
    finally:
        stop[0] = True
        sys.setswitchinterval(old)
        th.join()
    return moved


def gil_report(with_dynamo: bool) -> str:
    """Which of the calls the 2-thread replays make drop the GIL (a 500-block chain of one worker)."""
    from schemas.codec import encode_batch
    from schemas.events import BlockStored, KVEventBatch

    chain = list(range(500))
    toks = [t for h in chain for t in mt.block_tokens(h).tolist()]
    payload = encode_batch(KVEventBatch(0.0, [BlockStored([mt.engine_hash(h) for h in chain], None, toks, mt.BLOCK)]))
    ix = new_kvatlas(1)
    keys = ix.query_keys(MODEL, np.asarray(toks, dtype=np.uint32))
    out = [f"kvatlas apply_run {'yes' if gil_released(lambda: _apply(new_kvatlas(1), 'w0', payload), 10) else 'no'}"]
    _apply(ix, "w0", payload)
    out.append(f"kvatlas score_keys {'yes' if gil_released(lambda: ix.score_keys(MODEL, keys), 100) else 'no'}")
    if with_dynamo:
        from dynamo._core import RadixTree, compute_block_hash_for_seq

        tree = RadixTree()
        local = compute_block_hash_for_seq(toks, mt.BLOCK)
        ev = json.dumps({"event_id": 0, "dp_rank": 0, "data": {"stored": {"parent_hash": None, "blocks": [
            {"block_hash": mt.engine_hash(h), "tokens_hash": t} for h, t in zip(chain, local)]}}}).encode()
        out.append(f"dynamo apply_event {'yes' if gil_released(lambda: tree.apply_event(0, ev), 20) else 'no'}")
        out.append(f"dynamo find_matches {'yes' if gil_released(lambda: tree.find_matches(local)) else 'no'}")
    return ", ".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", action="store_true", help="3,000 requests on 400-block workers (< 30 s)")
    ap.add_argument("--requests", type=int, default=None, help="requests to generate (default 23,608)")
    ap.add_argument("--reps", type=int, default=None, help="best of this many replays per cell (default 3)")
    ap.add_argument("--capacity", type=int, default=None,
                    help=f"blocks per worker (default {CAPACITY}; --short: 400, so evictions happen)")
    ap.add_argument("--no-dynamo", action="store_true")
    args = ap.parse_args(argv)
    n = args.requests or (3_000 if args.short else mt.Shape().n_requests)
    reps = args.reps or 3
    cap = args.capacity or (400 if args.short else CAPACITY)
    reason = "--no-dynamo" if args.no_dynamo else dynamo_reason()
    t = time.perf_counter()
    records = mt.generate(mt.Shape(n_requests=n), seed=0)
    p = prepare(records, reason is None, keep_expected=True, capacity=cap)
    lens = np.array([r.input_length for r in records])
    print(f"trace: {n} requests (seed 0), mean input {lens.mean():.0f} tokens, "
          f"mean output {np.mean([r.output_length for r in records]):.0f}, prefix reuse {mt.prefix_reuse(records):.2f}; "
          f"{WORKERS} workers x {cap} blocks of {mt.BLOCK} tokens")
    stored = sum(len(s.blocks) - s.stored_from for s in p.steps)
    print(f"ops: {n} lookups + {stored} stored + {p.applied - stored} removed blocks = {p.ops} "
          f"(prepared in {time.perf_counter() - t:.1f}s); cpus {os.cpu_count()}, best of {reps}")
    if reason:
        print(f"Dynamo: not measured: {reason}")
    engines = [("kvatlas", replay_kvatlas)] + ([] if reason else [("dynamo", replay_dynamo)])
    times: dict[tuple[str, int], list[float]] = {}
    cpus: dict[tuple[str, int], list[float]] = {}  # process CPU seconds (all threads, Dynamo's own too)
    for _ in range(reps):  # interleaved: each rep measures every cell once
        for threads in (1, 2):
            for name, fn in engines:
                gc.collect()
                gc.disable()
                c0 = time.process_time()
                try:
                    dt, obj = fn(p, threads)
                finally:
                    cpu = time.process_time() - c0
                    gc.enable()
                del obj
                times.setdefault((name, threads), []).append(dt)
                cpus.setdefault((name, threads), []).append(cpu)
    best = {cell: min(ts) for cell, ts in times.items()}
    med = {cell: float(np.median(ts)) for cell, ts in times.items()}
    print(f"{'threads':>7} {'kvatlas ops/s':>14} {'dynamo ops/s':>13} {'kvatlas/dynamo':>15}   (best of {reps}; medians)")
    for threads in (1, 2):
        k, km = p.ops / best[("kvatlas", threads)], p.ops / med[("kvatlas", threads)]
        d = p.ops / best[("dynamo", threads)] if ("dynamo", threads) in best else None
        dm = p.ops / med[("dynamo", threads)] if ("dynamo", threads) in med else None
        if d is None or dm is None:
            print(f"{threads:>7} {k:>14,.0f} {'-':>13} {'-':>15}   ({km:,.0f})")
            continue
        print(f"{threads:>7} {k:>14,.0f} {d:>13,.0f} {k / d:>14.2f}x   ({km:,.0f} / {dm:,.0f} = {km / dm:.2f}x)")
    # On a shared machine wall time mostly measures the other tenants; CPU time is the work done.
    line = "ops per process CPU-second (median):"
    for threads in (1, 2):
        k = p.ops / float(np.median(cpus[("kvatlas", threads)]))
        d = p.ops / float(np.median(cpus[("dynamo", threads)])) if ("dynamo", threads) in cpus else None
        line += f"  {threads} thread{'s' if threads > 1 else ''}: kvatlas {k:,.0f}" + (
            f", dynamo {d:,.0f} = {k / d:.2f}x" if d else "")
    print(line)
    # untimed: every 1-thread lookup of both engines against the reference cluster's residency
    exact = []
    for name, fn, read in [("kvatlas", replay_kvatlas, kvatlas_matches), ("dynamo", replay_dynamo, dynamo_matches)]:
        if name == "dynamo" and reason:
            continue
        answers: list = []
        fn(p, 1, answers)
        bad = sum(1 for s, a in zip(p.steps, answers) if read(a) != s.expected)
        exact.append(f"{name} {len(answers) - bad}/{len(p.steps)}")
    print("lookups equal to the reference (1 thread): " + ", ".join(exact))
    print("drops the GIL (another Python thread ran during the calls): " + gil_report(reason is None))
    k1, k2 = p.ops / best[("kvatlas", 1)], p.ops / best[("kvatlas", 2)]
    line = f"scaling 2/1 threads: kvatlas {k2 / k1:.2f}x"
    if ("dynamo", 1) in best:
        line += f", dynamo {best[('dynamo', 1)] / best[('dynamo', 2)]:.2f}x"
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
