"""A load sweep of the routing policies, in process on the simulated clock, with an offline bound.

The same trace is replayed at several offered loads by scaling its timeline (arrivals × 1/f): the
offered load ρ is the prefill work a cache-aware placement computes — `approximate ×1`'s prefill
seconds on the unscaled trace, which do not depend on the queues — over the fleet's prefill capacity
(workers × the trace's span). Per load and policy (×1 and ×4 routers: `bench_policy_replay.replay`,
the demo's engines and caches driven from this thread, deterministic): prefill tokens, hit ratio,
TTFT p50 / p90 / p99, prediction. Then the **offline bound**, the same requests with hindsight:

- prefill: every block computed once in the whole trace (its first occurrence), i.e. a clairvoyant
  placement on a fleet with room for everything; no placement computes less;
- TTFT: each request's own share of that work (its never-seen blocks' prefill, its seen blocks'
  load-back from host) on an idle worker: no placement is faster for any request.

    .venv/bin/python -m bench.bench_sweep [--traces bundled,builtin-chat,builtin-conversation]
        [--loads 0.5,0.7,0.9,1.1,1.3] [--requests 300] [--seed 0] [--short]
"""
from __future__ import annotations

import argparse

from bench.bench_policy_replay import P, replay
from router_api.router.report import quantile
from router_api.router.trace import TokenExpander, TraceRequest, requests_for
from sim.api import SimModel

ROWS = (("round_robin", 1), ("least_loaded", 1), ("approximate", 1), ("precise_tiered", 1),
        ("approximate", 4), ("precise_tiered", 4))


def scaled(reqs: list[TraceRequest], f: float) -> list[TraceRequest]:
    """The trace at `f` times its request rate (arrivals divided by f)."""
    return [TraceRequest(r.index, r.arrival_s / f, r.input_length, r.output_length, r.hash_ids) for r in reqs]


def offline_bound(reqs: list[TraceRequest], sim: SimModel) -> dict[str, float]:
    """Hindsight floor: each block computed at its first occurrence only; each request alone on an
    idle worker holding every earlier block (loaded back from host)."""
    seen: set[int] = set()
    ttft: list[float] = []
    prefill = prompt = 0
    for r in reqs:
        held = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            held += 1
        cached = min(r.input_length, held * P)
        new = r.input_length - cached
        seen.update(r.hash_ids)
        computed = sum(1 for h in r.hash_ids[held:]) * P  # blocks past the held prefix: first seen or not
        computed = min(new, computed)
        prefill += computed
        prompt += r.input_length
        ttft.append(sim.load_s(cached, 0, 0) + sim.prefill_s(computed))
    return {"prefill": prefill, "hit": 1.0 - prefill / prompt, "mean": sum(ttft) / len(ttft),
            "p50": quantile(ttft, 0.5), "p90": quantile(ttft, 0.9), "p99": quantile(ttft, 0.99)}


def sweep(trace: str | None, n: int, seed: int, loads: list[float], workers: int, gpu_pages: int,
          host_pages: int, rows=ROWS, out=print) -> dict[float, dict[str, dict[str, float]]]:
    reqs = requests_for(trace, n, seed)
    ex = TokenExpander()
    tokens = [ex.tokens(r) for r in reqs]
    sim = SimModel()
    ref = replay("approximate", reqs, tokens, workers, seed, gpu_pages, host_pages)
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    work = len(reqs) * sim.prefill_overhead_s + ref["prefill"] / sim.prefill_tokens_per_s
    rho1 = work / (workers * span)
    out(f"\ntrace {trace or 'bundled'} (seed {seed}): {len(reqs)} requests over {span:.1f} s, {workers} workers; "
        f"offered load at the trace's own rate {rho1:.2f}")
    bound = offline_bound(reqs, sim)
    res: dict[float, dict[str, dict[str, float]]] = {}
    for rho in loads:
        f = rho / rho1
        sreqs = scaled(reqs, f)
        res[rho] = cur = {}
        out(f"load {rho:.2f} (rate x{f:.2f})")
        out(f"  {'policy':<18} {'prefill':>11} {'hit':>6} {'p50':>7} {'p90':>7} {'p99':>7} {'pred':>7}")
        for pol, k in rows:
            m = replay(pol, sreqs, tokens, workers, seed, gpu_pages, host_pages, routers=k)
            cur[f"{pol} x{k}"] = m
            acc = "-" if m["accuracy"] != m["accuracy"] else f"{100 * m['accuracy']:.1f}%"
            out(f"  {pol + ' x' + str(k):<18} {m['prefill']:>11,} {m['hit']:>6.3f} {m['p50']:>6.2f}s "
                f"{m['p90']:>6.2f}s {m['p99']:>6.2f}s {acc:>7}", flush=True)
        b = bound
        cur["offline bound"] = b
        out(f"  {'offline bound':<18} {b['prefill']:>11,} {b['hit']:>6.3f} {b['p50']:>6.2f}s {b['p90']:>6.2f}s "
            f"{b['p99']:>6.2f}s")
        t = cur.get("precise_tiered x1")
        if t:
            out(f"  precise_tiered x1: prefill {t['prefill'] / b['prefill']:.2f}x the bound, "
                f"p90 {t['p90'] / b['p90']:.2f}x; " + ", ".join(
                    f"{name}: prefill {t['prefill'] / o['prefill']:.3f}x p90 {t['p90'] / o['p90']:.3f}x"
                    for name, o in cur.items() if name not in ("precise_tiered x1", "offline bound")))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default="bundled,builtin-chat,builtin-conversation")
    ap.add_argument("--loads", default="0.5,0.7,0.9,1.1,1.3")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--gpu-pages", type=int, default=320)
    ap.add_argument("--host-pages", type=int, default=960)
    ap.add_argument("--short", action="store_true", help="40 requests, two loads, 2 workers (a smoke run)")
    a = ap.parse_args()
    loads = [float(x) for x in a.loads.split(",")]
    n, workers = a.requests, a.workers
    if a.short:
        n, workers, loads = 40, 2, [0.6, 1.2]
    for tr in a.traces.split(","):
        sweep(None if tr == "bundled" else tr, n, a.seed, loads, workers, a.gpu_pages, a.host_pages)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
