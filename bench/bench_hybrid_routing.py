"""Where usable-prefix routing can beat a group-blind index on a hybrid fleet: an in-process replay.

N simulated hybrid workers (each the cache and engine `kvatlas worker --family F` builds, driven
from this thread on the virtual clock), a trace replayed in arrival order, and the precise policies
scored straight from the workers' caches (no events, no index, no pending routes): `precise_kv_only`
sees the full-attention run over any tier, `precise_tiered` the usable prefix per tier. Per policy it
prints prefill tokens, p90 TTFT and prediction accuracy, the ratio of precise_tiered to
precise_kv_only, and two counts that say whether a better choice existed at all:

- `kv>usable`: worker rows (requests x workers) whose full-attention run is longer than its usable
  prefix — where a group-blind index promises a hit the worker cannot use;
- `better elsewhere`: requests sent to a worker while another worker could resume from a longer
  usable prefix — the only requests on which knowing the usable prefix can save prefill.

It is a fast stand-in for `kvatlas demo --family F` (same worker code and policies, seconds per run
instead of minutes; its figures track the demo's but are not identical: no router/worker processes,
no event lag, no pending routes). Every copy and L3 write lands before the next arrival, so a run's
figures are deterministic. `--worker-args "--host-pages 0"` runs GPU-only workers (no L3).

    .venv/bin/python -m bench.bench_hybrid_routing --family swa [--trace builtin-chat] [--seed 1]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter


from producer.cache import TieredCache  # noqa: E402
from producer.components.base import DEVICE, HOST, STORAGE  # noqa: E402
from sim import cmd as worker_cmd  # noqa: E402
from sim.api import SimModel  # noqa: E402
from sim.engine import Engine  # noqa: E402
from producer.storage.config import make_storage_backend  # noqa: E402
from producer.storage.worker import StorageWorker  # noqa: E402
from router_api.demo.fleet import MODEL_BLOCK  # noqa: E402
from router_api.router.policies import RouteInput, ScoreRow, make_policy  # noqa: E402
from router_api.router.report import quantile  # noqa: E402
from router_api.router.trace import TokenExpander, requests_for  # noqa: E402

P = MODEL_BLOCK


def make_engine(family: str, l3_dir: str, extra: list[str]) -> Engine:
    p = argparse.ArgumentParser()
    worker_cmd.add_arguments(p)
    args = p.parse_args(["--family", family, "--block-size", str(P), *extra])
    # the demo's file L3; none for a GPU-only worker (--host-pages 0: SGLang without HiCache)
    storage = StorageWorker(make_storage_backend("file", {"root": l3_dir})) if args.host_pages else None
    cache = worker_cmd._make_cache(args, storage, None)
    engine = Engine(cache, SimModel(**worker_cmd.FAMILY_SIM.get(family, {})),
                    chunk_pages=args.chunk_tokens // P,
                    running_state_share=args.running_state_share if family == "mamba" else 0.0)
    engine.close()  # served from this thread: the cache's only user
    return engine


def tally(counts: Counter, ttft: list[float], d, s) -> None:
    """One served request into the replay's figures: TTFT, prefill computed, prediction exact or not."""
    ttft.append(s.ttft_s)
    counts["prefill"] += s.tokens.computed
    if d.predicted_cached is not None:
        counts["predicted"] += 1
        counts["exact"] += d.predicted_cached == s.tokens.cached


def close_engines(engines: list[Engine]) -> None:
    """Stop each engine's copy threads and storage worker."""
    for e in engines:
        if e.cache.transfer is not None:
            e.cache.transfer.close()
        if e.cache.storage is not None:
            e.cache.storage.close()


def settle(cache: TieredCache) -> None:
    """Land every copy and L3 write in flight: requests arrive seconds apart on the virtual clock and
    a copy takes milliseconds, so each one finds the previous ones' copies landed — and the replay
    does not depend on how fast this machine's copy threads ran (the figures are deterministic)."""
    for _ in range(3):
        cache.wait_transfers(5.0)
        cache.step()
        if cache.storage is not None:
            cache.storage.wait_idle(5.0)
            cache.step()


def score_row(engine: Engine, tokens: list[int]) -> tuple[ScoreRow, int, int]:
    """The worker's row as the index would answer it, its usable prefix and its KV run (blocks)."""
    c = engine.cache
    path, _ = c.tree.match(c.tree.page_key(tokens), c.tick, c._usable)
    kv = 0
    for node in path:
        if not any(c._kv_on(node, t) for t in (DEVICE, HOST, STORAGE)):
            break
        kv += len(node.key) // P
    dev, host, best, _ = c.usable_pages(path)
    return ScoreRow(dev, best, host - dev, best - host, 0, 0, kv), best, kv


def replay(policy_name: str, family: str, reqs: list, tokens: list[list[int]], workers: int,
           seed: int, extra: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="kvatlas-hybrid-routing-") as tmp:
        engines = [make_engine(family, f"{tmp}/l3-{j}", extra) for j in range(workers)]
        ids = [f"w{j}" for j in range(workers)]
        policy = make_policy(policy_name, ids, engines[0].sim, seed)
        ttft: list[float] = []
        counts: Counter[str] = Counter()
        for r, t in zip(reqs, tokens):
            rows, usable = {}, {}
            for w, e in zip(ids, engines):
                settle(e.cache)
                rows[w], usable[w], kv = score_row(e, t)
                counts["kv>usable"] += kv > usable[w]
            backlog = {w: e.schedule.backlog_at(r.arrival_s) for w, e in zip(ids, engines)}
            d = policy.choose(RouteInput(len(t), [], P, rows, backlog, {}))
            counts["better elsewhere"] += usable[d.worker_id] < max(usable.values())
            s = engines[ids.index(d.worker_id)]._serve(t, r.output_length, r.arrival_s)
            tally(counts, ttft, d, s)
        close_engines(engines)
    acc = counts["exact"] / counts["predicted"] if counts["predicted"] else float("nan")
    return {"prefill": counts["prefill"], "p90": quantile(ttft, 0.9), "accuracy": acc,
            "kv>usable": counts["kv>usable"], "better elsewhere": counts["better elsewhere"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=("mamba", "swa"), default="mamba")
    ap.add_argument("--trace", default=None, help="as kvatlas demo --trace (default: the bundled trace)")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--policies", default="round_robin,precise_kv_only,precise_tiered")
    ap.add_argument("--worker-args", default="", help="extra kvatlas worker options, e.g. '--mamba-states 20'")
    a = ap.parse_args()
    reqs = requests_for(a.trace, a.requests, a.seed)
    ex = TokenExpander()
    tokens = [ex.tokens(r).tolist() for r in reqs]
    print(f"family {a.family}, trace {a.trace or 'bundled'} (seed {a.seed}), {len(reqs)} requests, "
          f"{a.workers} workers, in-process replay")
    res = {}
    for pol in a.policies.split(","):
        res[pol] = m = replay(pol, a.family, reqs, tokens, a.workers, a.seed, a.worker_args.split())
        print(f"{pol:<16} prefill {m['prefill']:>11,}  p90 TTFT {m['p90']:6.2f}s  prediction "
              f"{100 * m['accuracy']:5.1f}%  kv>usable rows {m['kv>usable']:4}  "
              f"better elsewhere {m['better elsewhere']:4}", flush=True)
    if "precise_kv_only" in res and "precise_tiered" in res:
        k, t = res["precise_kv_only"], res["precise_tiered"]
        print(f"precise_tiered / precise_kv_only: prefill {t['prefill'] / k['prefill']:.4f}x, "
              f"p90 TTFT {t['p90'] / k['p90']:.4f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
