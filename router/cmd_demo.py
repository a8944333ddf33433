"""`kvatlas demo`: the indexer, workers and routers as real processes on loopback, a bounded slice
of the bundled trace replayed under each routing policy, one table (docs/end-to-end.md).
`--in-process` runs the fast single-process example instead (router.demo.inprocess); `--openai`
drives chats through `kvatlas router --api openai` instead (router.demo.openai_demo, docs/openai.md)."""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None,
                   help="Mooncake JSONL trace (default: the bundled synthetic trace), or 'builtin-chat': a "
                        "bursty chat workload, one system prompt shared by every conversation, or "
                        "'builtin-conversation': long multi-turn conversations (both seeded by --seed)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests in the slice (default 300; in-process: 400 synthetic requests)")
    p.add_argument("--speed", type=float, default=12.0, help="replay speed, virtual s per wall s (default 12)")
    p.add_argument("--policies", default=None,
                   help="comma-separated policies, each run with one router (default: the six but "
                        "precise_kv_only; a hybrid --family: round_robin, least_loaded, approximate, "
                        "precise_kv_only, precise_tiered)")
    p.add_argument("--routers", type=int, default=4,
                   help="adds rows running approximate and precise_tiered with K router replicas "
                        "(default 4; 1 adds none)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the table as JSON here")
    p.add_argument("--workers", type=int, default=4, help="number of workers (default 4)")
    p.add_argument("--gpu-pages", type=int, default=320, help="GPU pages per worker (default 320)")
    p.add_argument("--host-pages", type=int, default=960, help="host pages per worker (default 960)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--admission-timeout", type=float, default=2.0,
                   help="routers' causal forwarding: wall seconds a request waits at most for the in-flight "
                        "requests its prediction counts on to be admitted (0 = off; default 2)")
    p.add_argument("--wall-clock", action="store_true",
                   help="replay paced on the wall clock with requests concurrent (routers poll load, causal "
                        "forwarding waits): the rows then vary run to run; default: lockstep on the simulated "
                        "clock, every row repeats exactly (docs/end-to-end.md, \"Lockstep\")")
    p.add_argument("--l3", choices=("file", "mooncake"), default="file",
                   help="the workers' L3: a local directory each (DISK), or one Mooncake Store all of a run's "
                        "workers share (EXTERNAL; the demo starts its mooncake_master)")
    p.add_argument("--family", choices=("full", "mamba", "swa", "dsa"), default="full",
                   help="the workers' model family (kvatlas worker --family): a hybrid's default runs put "
                        "precise_kv_only (routing on kv_blocks, as group-blind indexers do) beside precise_tiered "
                        "(the usable prefix); see docs/hybrid.md")
    p.add_argument("--in-process", action="store_true",
                   help="the fast example: caches, ZMQ and the index in one process (no HTTP)")
    p.add_argument("--openai", action="store_true",
                   help="the OpenAI path: chats through kvatlas router --api openai to workers speaking vLLM's API "
                        "(--requests: conversations, default 16; --policies default round_robin,approximate,"
                        "precise_tiered; needs a source checkout for its tokenizer)")
    p.add_argument("--page-size", type=int, default=16, help="in-process only: tokens per page (default 16)")
    p.add_argument("--device-pages", type=int, default=96, help="in-process only: GPU pages (default 96)")


def _in_process(args: argparse.Namespace) -> int:
    try:
        from router.demo.inprocess import DemoConfig, main
    except ImportError as exc:
        raise SystemExit(f"kvatlas demo needs the producer extra (torch): {exc}") from None
    host_pages = 384 if args.host_pages == 960 else args.host_pages
    cfg = DemoConfig(workers=args.workers, requests=args.requests or 400, page_size=args.page_size,
                     device_pages=args.device_pages, host_pages=host_pages, seed=args.seed or 7)
    return main(cfg)


def _openai(args: argparse.Namespace) -> int:
    from router.demo.openai_demo import TOKENIZER, run_openai_demo
    from router.policies import POLICIES

    if not (TOKENIZER / "tokenizer.json").is_file():
        raise SystemExit(f"kvatlas demo --openai needs the test tokenizer at {TOKENIZER} (a source checkout)")
    policies = tuple(p.strip() for p in (args.policies or "round_robin,approximate,precise_tiered").split(",")
                     if p.strip())
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise SystemExit(f"--policies: unknown {bad or 'empty list'}; expected some of {', '.join(POLICIES)}")
    run_openai_demo(policies, args.workers, args.requests or 16, args.seed, args.speed, args.gpu_pages, sys.stdout)
    return 0


def run(args: argparse.Namespace) -> int:
    from router_api.procs import exit_on_signals

    with exit_on_signals():  # SIGTERM / SIGHUP stop the children as Ctrl-C does (router_api/procs.py)
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from router.policies import POLICIES

    for name in ("workers", "page_size", "device_pages", "host_pages", "gpu_pages", "routers"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    if args.requests is not None and args.requests <= 0:
        raise SystemExit("--requests must be positive")
    if args.speed <= 0:
        raise SystemExit("--speed must be positive")
    if not 0 <= args.admission_timeout <= 30:
        raise SystemExit("--admission-timeout must be within [0, 30] seconds")
    if args.family != "full" and (args.in_process or args.openai):
        raise SystemExit("--family runs the process demo (not --in-process or --openai)")
    if args.in_process:
        return _in_process(args)
    if args.openai:
        return _openai(args)
    from router.demo.fleet import HYBRID_POLICIES, DemoSettings, rows_json, run_demo

    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip()) if args.policies else None
    bad = [p for p in policies or () if p not in POLICIES]
    if bad or policies == ():
        raise SystemExit(f"--policies: unknown {bad or 'empty list'}; expected some of {', '.join(POLICIES)}")
    if not policies and args.family != "full":
        policies = HYBRID_POLICIES
    kw = {"policies": policies} if policies else {}
    s = DemoSettings(trace=args.trace, requests=args.requests or 300, speed=args.speed, routers=args.routers,
                     workers=args.workers, gpu_pages=args.gpu_pages, host_pages=args.host_pages, seed=args.seed,
                     family=args.family, admission_timeout=args.admission_timeout, l3=args.l3,
                     lockstep=not args.wall_clock, **kw)
    from router.trace import BUILTIN_TRACES, TraceError, load_trace
    if args.trace and args.trace not in BUILTIN_TRACES:
        try:
            load_trace(args.trace)
        except TraceError as exc:
            raise SystemExit(f"--trace: {exc}") from None
    rows = run_demo(s)
    if args.json_out:
        with open(args.json_out, "wb") as f:
            f.write(rows_json(rows))
        print(f"\ntable written to {args.json_out}", file=sys.stderr)
    return 0
