"""The routing policies on one fleet, in process: a fast, deterministic stand-in for `kvatlas demo`
with one router (full-attention model).

N simulated workers (each the cache and engine `kvatlas worker` builds: GPU + host pages, a file L3,
driven from this thread on the virtual clock), a trace replayed in arrival order, one router. The
precise policies read each worker's row straight from its cache (what the index shows once the
worker's events landed; every request here reaches its worker before the next decision, so there
are no pending routes) and its backlog from its timeline; `approximate` keeps its own tree and counts
a request in flight until its simulated completion. Per policy: prefill tokens, TTFT mean / p90 and
prediction accuracy, then precise_tiered's ratios to the others.

Its precise rows equal the demo's ×1 rows (checked on the bundled trace, builtin-chat seeds 0, 3
and 8 and builtin-conversation: the same prefill tokens and p90), and so does a `round_robin` row
whenever the demo's requests reached their workers in trace order. `replay(..., routers=K)` runs K
replicas of a policy (bench/bench_sweep.py's ×4 rows). Its `approximate` row is that policy's best case: every
request reaches its worker in trace order, as in the demo only when the machine keeps up (the demo's
row moves from run to run). No processes, no event lag; copies between tiers land before the next
request.

    .venv/bin/python -m bench.bench_policy_replay [--trace builtin-chat] [--seed 1] [--requests 300]
"""
from __future__ import annotations

import argparse
import bisect
import os
import tempfile
from collections import Counter


from producer.components.base import DEVICE, HOST, STORAGE  # noqa: E402
from sim import cmd as worker_cmd  # noqa: E402
from sim.api import SimModel  # noqa: E402
from sim.engine import Engine  # noqa: E402
from producer.storage.config import make_storage_backend  # noqa: E402
from producer.storage.worker import StorageWorker  # noqa: E402
from router.demo.fleet import MODEL_BLOCK  # noqa: E402
from router.decision import block_keys  # noqa: E402
from router.policies import RouteInput, ScoreRow, make_policy  # noqa: E402
from router.report import quantile  # noqa: E402
from router.trace import TokenExpander, requests_for  # noqa: E402

from bench.bench_hybrid_routing import close_engines, tally

P = MODEL_BLOCK


def make_engine(l3_dir: str, gpu_pages: int, host_pages: int) -> Engine:
    p = argparse.ArgumentParser()
    worker_cmd.add_arguments(p)
    args = p.parse_args(["--block-size", str(P), "--gpu-pages", str(gpu_pages), "--host-pages", str(host_pages)])
    storage = StorageWorker(make_storage_backend("file", {"root": l3_dir}))
    engine = Engine(worker_cmd._make_cache(args, storage, None), SimModel())
    engine.close()  # served from this thread: the cache's only user
    return engine


def score_row(engine: Engine, tokens: list[int]) -> ScoreRow:
    """The worker's row as the index answers it once its events landed (blocks per tier)."""
    c = engine.cache
    path, _ = c.tree.match(c.tree.page_key(tokens), c.tick, c._usable)
    dev, host, best, _ = c.usable_pages(path)
    return ScoreRow(dev, best, host - dev, best - host, 0, 0)


class Replica:
    """One router replica's own state: its policy and the completion times of the requests it sent
    (its in-flight view: a replica knows only its own sends)."""

    __slots__ = ("policy", "ends")

    def __init__(self, policy, ids: list[str]) -> None:
        self.policy = policy
        self.ends: dict[str, list[float]] = {w: [] for w in ids}


def replay(policy_name: str, reqs: list, tokens: list[list[int]], workers: int, seed: int,
           gpu_pages: int, host_pages: int, routers: int = 1) -> dict[str, float]:
    """Replay `reqs` (in arrival order) through `routers` replicas of one policy (request i to replica
    i mod routers) on `workers` engines. Every replica reads the same exact rows and timelines (the
    shared index and the shared end times); each keeps its own tree (`approximate`), tie-break and
    in-flight counts. Figures: prefill tokens, hit ratio, TTFT mean / p50 / p90 / p99, prediction."""
    # the file L3 in memory when there is a tmpfs: the figures are on the virtual clock either way
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="kvatlas-policy-replay-", dir=shm) as tmp:
        engines = [make_engine(f"{tmp}/l3-{j}", gpu_pages, host_pages) for j in range(workers)]
        ids = [f"w{j}" for j in range(workers)]
        reps = [Replica(make_policy(policy_name, ids, engines[0].sim, seed + k), ids) for k in range(routers)]
        ttft: list[float] = []
        counts: Counter[str] = Counter()
        for i, (r, t) in enumerate(zip(reqs, tokens)):
            rep = reps[i % routers]
            for e in engines:
                e.cache.wait_transfers(10.0)
                e.cache.step()
            rows = {w: score_row(e, t) for w, e in zip(ids, engines)} if rep.policy.uses_index else None
            backlog = {w: e.schedule.backlog_at(r.arrival_s) for w, e in zip(ids, engines)}
            inflight = {w: len(rep.ends[w]) - bisect.bisect_right(rep.ends[w], r.arrival_s) for w in ids}
            keys = block_keys(t, P) if policy_name == "approximate" else []
            d = rep.policy.choose(RouteInput(len(t), keys, P, rows, backlog, inflight))
            s = engines[ids.index(d.worker_id)]._serve(t, r.output_length, r.arrival_s)
            bisect.insort(rep.ends[d.worker_id], r.arrival_s + s.e2e_s)
            tally(counts, ttft, d, s)
            counts["prompt"] += len(t)
        close_engines(engines)
    acc = counts["exact"] / counts["predicted"] if counts["predicted"] else float("nan")
    return {"prefill": counts["prefill"], "hit": 1.0 - counts["prefill"] / max(1, counts["prompt"]),
            "mean": sum(ttft) / len(ttft), "p50": quantile(ttft, 0.5), "p90": quantile(ttft, 0.9),
            "p99": quantile(ttft, 0.99), "accuracy": acc}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=None, help="as kvatlas demo --trace (default: the bundled trace)")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--gpu-pages", type=int, default=320)
    ap.add_argument("--host-pages", type=int, default=960)
    ap.add_argument("--policies", default="round_robin,approximate,precise_tiered")
    a = ap.parse_args()
    reqs = requests_for(a.trace, a.requests, a.seed)
    ex = TokenExpander()
    tokens = [ex.tokens(r) for r in reqs]
    print(f"trace {a.trace or 'bundled'} (seed {a.seed}), {len(reqs)} requests, {a.workers} workers, "
          f"in-process replay, one router")
    res = {}
    for pol in a.policies.split(","):
        res[pol] = m = replay(pol, reqs, tokens, a.workers, a.seed, a.gpu_pages, a.host_pages)
        acc = "-" if m["accuracy"] != m["accuracy"] else f"{100 * m['accuracy']:5.1f}%"
        print(f"{pol:<16} prefill {m['prefill']:>11,}  TTFT mean {m['mean']:5.2f}s  p90 {m['p90']:5.2f}s  "
              f"prediction {acc}", flush=True)
    if "precise_tiered" in res:
        t = res["precise_tiered"]
        for other, o in res.items():
            if other != "precise_tiered":
                print(f"precise_tiered / {other}: prefill {t['prefill'] / o['prefill']:.4f}x, "
                      f"p90 TTFT {t['p90'] / o['p90']:.4f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
