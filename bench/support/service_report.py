"""The printed part of bench/bench_service.py: one run's rows (`report`), its ratios against the
issue's targets (`ratios`) and the table of every run and shape (`summary`)."""
from __future__ import annotations

import argparse
from typing import Any

from bench.support.service_stream import SIZES  # query sizes in tokens


def pct(ts: list[float], q: float) -> float:
    s = sorted(ts)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3


def report(args: argparse.Namespace, results: dict[str, dict[str, Any]], dyn_reason: str | None) -> None:
    ours, dyn = results["kvatlas"], results.get("dynamo")
    print(f"\n{'':28}{'kvatlas':>14}{'dynamo':>14}{'ratio':>10}")

    def row(label: str, a: float, b: float | None, fmt: str = "{:14.3f}") -> None:
        r = "" if not b else f"{a / b:10.2f}"
        print(f"{label:28}{fmt.format(a)}{fmt.format(b) if b is not None else '':>14}{r}")

    row("ingest blocks/s, live", ours["blocks_per_s"], dyn and dyn["blocks_per_s"], "{:14,.0f}")
    row("  (sender done after, s)", ours["send_s"], dyn and dyn["send_s"])
    row("  (visible after, s)", ours["ingest_s"], dyn and dyn["ingest_s"])
    row("ingest blocks/s, backlog", ours["backlog_blocks_per_s"], dyn and dyn["backlog_blocks_per_s"], "{:14,.0f}")
    row("ingest CPU us / block", ours["cpu_us_per_block"], dyn and dyn["cpu_us_per_block"])
    row("RSS bytes / block", ours["rss_per_block_b"], dyn and dyn["rss_per_block_b"], "{:14.1f}")
    row("RSS bytes / block, 1 s on", ours["rss_settled_per_block_b"], dyn and dyn["rss_settled_per_block_b"],
        "{:14.1f}")
    row("RSS bytes / resident entry", ours["rss_per_entry_b"], dyn and dyn["rss_per_entry_b"], "{:14.1f}")
    row("  (1 s on)", ours["rss_settled_per_entry_b"], dyn and dyn["rss_settled_per_entry_b"], "{:14.1f}")
    for q, qn in ((0.5, "p50"), (0.99, "p99")):
        d = dyn and pct(dyn["lat"]["health"][SIZES[0]], q)
        row(f"GET /health {qn} (ms)", pct(ours["lat"]["health"][SIZES[0]], q), d)
    for size in SIZES:
        for q, qn in ((0.5, "p50"), (0.99, "p99")):
            d = dyn and pct(dyn["lat"]["json"][size], q)
            row(f"{size // 1024}k tok {qn} JSON (ms)", pct(ours["lat"]["json"][size], q), d)
            row(f"{size // 1024}k tok {qn} msgpack (ms)", pct(ours["lat"]["msgpack"][size], q), d)
            row(f"{size // 1024}k tok {qn} binary (ms)", pct(ours["lat"]["binary"][size], q), d)
    checked, bad = ours["exact"]
    print(f"answers checked against the streams' truth: {checked} (both services), "
          f"{'all exact' if not bad else 'MISMATCHES: ' + '; '.join(bad)}")
    if dyn is not None:
        probs = dyn.get("log_problems", [])
        print(f"dynamo's log: {len(probs)} WARN / ERROR lines" + "".join(f"\n  {ln[:200]}" for ln in probs[:5]))
    asgi = results.get("kvatlas-asgi")
    if asgi is not None:
        print("\nsame run, kvatlas with --http-fast-path off (the ASGI front) / kvatlas default (protocol fast path):")
        for size in SIZES:
            for fmt in ("json", "binary"):
                a, b = pct(asgi["lat"][fmt][size], 0.5), pct(ours["lat"][fmt][size], 0.5)
                print(f"  {size // 1024}k tok p50 {fmt:7} asgi {a:7.3f} ms  fast {b:7.3f} ms  asgi/fast {a / b:5.2f}")
    emb = results.get("embedded")
    if emb is not None:
        print("\nembedded mode (router_api.embedded, in this process, u32 array in; ratio vs dynamo's HTTP JSON p50):")
        for size in SIZES:
            d = dyn and pct(dyn["lat"]["json"][size], 0.5)
            row(f"{size // 1024}k tok p50 embedded (ms)", pct(emb["embedded"][size], 0.5), d)
            row(f"{size // 1024}k tok p50 lookup only (ms)", pct(emb["lookup"][size], 0.5), d)
    if dyn is None:
        print(f"\nDynamo not measured: {dyn_reason}")


# The done-when targets (issue 25): (label, ratio of, higher is better, bound)
TARGETS = (("ingest live", "live", True, 1.5), ("backlog", "backlog", True, 1.5), ("RSS/entry", "rss", False, 0.5),
           ("JSON 1k", "json1", False, 1.0), ("JSON 8k", "json8", False, 1.0), ("JSON 32k", "json32", False, 1.0),
           ("raw 8k", "raw8", False, 0.5), ("raw 32k", "raw32", False, 0.5))


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    ours, dyn = results["kvatlas"], results["dynamo"]

    def p50(r: dict[str, Any], fmt: str, size: int) -> float:
        return pct(r["lat"][fmt][size], 0.5)
    return {"health_ms": p50(ours, "health", SIZES[0]), "dyn_health_ms": p50(dyn, "health", SIZES[0]),
            "dyn8_ms": p50(dyn, "json", SIZES[1]), "dyn_log": float(len(dyn.get("log_problems", []))),
            "live": ours["blocks_per_s"] / dyn["blocks_per_s"],
            "backlog": ours["backlog_blocks_per_s"] / dyn["backlog_blocks_per_s"],
            "rss": ours["rss_per_entry_b"] / dyn["rss_per_entry_b"],
            **{f"json{s // 1024}": p50(ours, "json", s) / p50(dyn, "json", s) for s in SIZES},
            **{f"raw{s // 1024}": p50(ours, "binary", s) / p50(dyn, "json", s) for s in SIZES[1:]}}


def summary(args: argparse.Namespace, table: list[tuple[int, str, dict[str, float], str]]) -> None:
    """One row per run and shape: the ratios kvatlas / Dynamo against the targets (* = missed)."""
    print(f"\nsummary: kvatlas {'--ingest-shards ' + args.ingest_shards if args.ingest_shards else '(no flags)'} / "
          f"Dynamo --threads {args.dynamo_threads}, {args.workers} publishers; * = target missed")
    print(f"{'run':>4} {'stream shape':12}" + "".join(f"{label:>13}" for label, *_ in TARGETS)
          + "  answers     /health ms (ours, dyn)  dyn 8k ms  dyn log")
    for run, shape, r, exact in table:
        cells = []
        for _label, key, up, bound in TARGETS:
            ok = r[key] >= bound if up else r[key] <= bound
            cells.append(f"{r[key]:12.2f}{' ' if ok else '*'}")
        print(f"{run:>4} {shape:12}" + "".join(cells) + f"  {exact}  {r['health_ms']:8.3f} {r['dyn_health_ms']:8.3f}"
              f"  {r['dyn8_ms']:13.3f}  {int(r['dyn_log']):7d}")
    print("streams: 'share' = system prompts shared across the fleet, 'unsha' = every request the worker's own, "
          "some evicted (nearly every node one holder)")
    print("targets: ingest (live, backlog) >= 1.5, RSS per resident (worker, block) entry <= 0.5, /score JSON p50 <= 1.0, "
          "raw u32 p50 (vs Dynamo's JSON) <= 0.5")
    print("absolute p50s: /health of both and Dynamo's JSON 8k move together from phase to phase on a shared "
          "host (the round-trip floor), whatever the shape; 'dyn log': Dynamo's WARN / ERROR lines (dropped "
          "or unparsed events would show there, and in the answer check, as fewer matched blocks)")
