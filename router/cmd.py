"""`kvatlas router`: a KV-aware router process, in one of two APIs.

- `--api openai` (the default without `--trace`): an OpenAI-compatible proxy in front of vLLM /
  SGLang engines or `kvatlas worker`s (router/proxy/, docs/openai.md).
- `--api sim` (the default with `--trace`): replays a trace (its share of it, as replica I of K) at
  scaled speed as token-id completions through an OpenAI router (`--via URL`, or one started in this
  process over `kvatlas worker`s, serving on `--port`) and writes the per-request report as JSON
  (docs/end-to-end.md). Every request is decided by the one decision path (router/decision.py)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from typing import Any

log = logging.getLogger("kvatlas.router")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--indexer", default=None, help="indexer URL (needed by the precise policies)")
    p.add_argument("--indexer-token-file", default=None,
                   help="bearer token of an indexer run with auth (first line of the file; default $KVATLAS_AUTH_TOKEN)")
    p.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body of /v1/* (default 8 MiB)")
    p.add_argument("--worker", action="append", default=[], metavar="ID=URL",
                   help="a worker: its id (as registered at the indexer) and HTTP URL (repeatable)")
    p.add_argument("--policy", default="precise_tiered",
                   help="round_robin | random | least_loaded | approximate | precise_gpu | precise_tiered | precise_kv_only")
    p.add_argument("--model", default="default", help="model namespace at the indexer (default 'default')")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8800, help="HTTP port (default 8800; 0 = no HTTP server)")
    p.add_argument("--trace", default=None,
                   help="Mooncake JSONL trace to replay ('builtin' = multi-turn generator, 'builtin-chat' = "
                        "bursty shared-system-prompt chat generator, 'builtin-conversation' = long "
                        "multi-turn conversations)")
    p.add_argument("--requests", type=int, default=0, help="bounded conversation-preserving slice (0 = all)")
    p.add_argument("--speed", type=float, default=1.0, help="replay speed: virtual seconds per wall second")
    p.add_argument("--replicas", type=int, default=1, help="router replicas sharing the trace (default 1)")
    p.add_argument("--replica-index", type=int, default=0, help="this replica: takes requests i with i %% K == I")
    p.add_argument("--start-at", type=float, default=None, help="wall-clock epoch at which the trace starts")
    p.add_argument("--report", default=None, help="write the per-request report here (JSON) after the replay")
    p.add_argument("--exit-after-replay", action="store_true", help="exit once the replay is done")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--admission-timeout", type=float, default=2.0,
                   help="wall seconds a request waits at most for the worker to admit the in-flight requests "
                        "its prediction counts on (causal forwarding, docs/CONTRACTS.md; 0 = off; default 2)")
    p.add_argument("--via", default=None, metavar="URL",
                   help="with --trace: replay through this OpenAI router (kvatlas router --api openai) as token-id "
                        "completions, in place of one started in this process (router/replay.py)")
    p.add_argument("--lockstep", action="store_true",
                   help="the simulated clock decides (kvatlas worker fleets; docs/end-to-end.md \"Lockstep\"): "
                        "openai: load read at each request's kvatlas_arrival_s, in-flight counted on the virtual "
                        "clock; --via: one request at a time, the next once the previous one was served "
                        "(--via may then name several routers, request i going to the (i mod K)-th)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--api", choices=("openai", "sim"), default=None,
                   help="openai: OpenAI-compatible proxy (/v1/completions, /v1/chat/completions) in front of "
                        "vLLM / SGLang / kvatlas workers; sim: trace replay through that proxy "
                        "(default: sim with --trace, else openai)")
    p.add_argument("--tokenizer", action="append", default=[], metavar="[MODEL=]DIR",
                   help="openai: the model's Hugging Face tokenizer directory, to tokenize requests as the engine does")
    p.add_argument("--metrics-interval", type=float, default=1.0,
                   help="openai: seconds between polls of each worker's Prometheus /metrics (default 1)")
    p.add_argument("--block-size", type=int, default=16,
                   help="openai: block size until the indexer's /score says it (default 16)")
    p.add_argument("--forward-token-ids", action="store_true",
                   help="openai: forward a completions text prompt as the token ids that were scored")
    p.add_argument("--first-byte-timeout", type=float, default=300.0,
                   help="openai: seconds an engine may take to begin its answer before the request is retried "
                        "on another worker and the engine marked down (default 300)")
    p.add_argument("--request-timeout", type=float, default=10.0,
                   help="openai: seconds a client has to send a request's head and body (default 10)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="openai: open client connections at most; more are refused with 503 (default 1024)")
    p.add_argument("--decision-log-rate", type=float, default=0.0,
                   help="openai: share of requests whose decision is logged (logger kvatlas.router.decisions; "
                        "default 0: off)")
    p.add_argument("--workers-interval", type=float, default=5.0,
                   help="openai: seconds between reads of the indexer's worker registry (0: only --worker)")
    p.add_argument("--reuse-port", action="store_true",
                   help="openai: SO_REUSEPORT, so several router processes share --port")
    p.add_argument("--sim", default=None,
                   help="openai: cost model of the policies as JSON (sim.api.SimModel fields)")


def parse_workers(specs: list[str], required: bool = True) -> dict[str, str]:
    out: dict[str, str] = {}
    for spec in specs:
        wid, sep, url = spec.partition("=")
        if not sep or not wid.strip() or not url.startswith(("http://", "https://")):
            raise ValueError(f"worker {spec!r}: expected ID=http://host:port")
        if wid in out:
            raise ValueError(f"worker {wid!r} given twice")
        out[wid.strip()] = url.strip().rstrip("/")
    if not out and required:
        raise ValueError("at least one --worker ID=URL is needed")
    return out


def select_requests(args: argparse.Namespace) -> list[Any]:
    from router.trace import requests_for

    reqs = requests_for(args.trace, args.requests, args.seed)
    return [r for r in reqs if r.index % args.replicas == args.replica_index]


def run(args: argparse.Namespace) -> int:
    from router.policies import POLICIES, PRECISE
    from router.trace import TraceError

    api = args.api or ("sim" if args.trace else "openai")
    if api == "openai":
        try:
            workers = parse_workers(args.worker, required=not args.indexer)
            if args.trace:
                raise ValueError("--trace replays through --api sim")
            if args.policy not in POLICIES:
                raise ValueError(f"unknown policy {args.policy!r}; expected one of {', '.join(POLICIES)}")
        except ValueError as exc:
            print(f"kvatlas router: {exc}", file=sys.stderr)
            return 2
        from router.proxy.cmd import run as run_openai

        return run_openai(args, workers)
    try:
        workers = parse_workers(args.worker, required=not args.via)
        if not args.trace:
            raise ValueError("--api sim replays a --trace (to serve requests: --api openai)")
        if args.policy not in POLICIES:
            raise ValueError(f"unknown policy {args.policy!r}; expected one of {', '.join(POLICIES)}")
        if args.policy in PRECISE and not args.indexer and not args.via:
            raise ValueError(f"policy {args.policy} needs --indexer")
        if args.replicas < 1 or not 0 <= args.replica_index < args.replicas:
            raise ValueError("need --replicas >= 1 and 0 <= --replica-index < --replicas")
        if args.speed <= 0 or args.requests < 0:
            raise ValueError("--speed must be positive and --requests >= 0")
        if not 0 <= args.admission_timeout <= 30:
            raise ValueError("--admission-timeout must be within [0, 30] seconds")
        reqs = select_requests(args) if args.trace else None
    except (ValueError, TraceError) as exc:
        print(f"kvatlas router: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_main(args, workers, reqs))
    except (TimeoutError, ValueError) as exc:
        print(f"kvatlas router: {exc}", file=sys.stderr)
        return 1


def _write_report(args: argparse.Namespace, records: list[Any]) -> None:
    import msgspec

    from router.records import RouterReport

    rep = RouterReport(policy=args.policy, replica=args.replica_index, replicas=args.replicas,
                       records=sorted(records, key=lambda r: r.index))
    # temp + rename: a reader (a script, the compose test) never sees a half-written report
    tmp = f"{args.report}.tmp"
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(rep))
    os.replace(tmp, args.report)


async def _replay_via(args: argparse.Namespace, reqs: list[Any]) -> int:
    """The trace through an OpenAI router (router/replay.py): what `kvatlas demo` measures."""
    from router.progress import Progress
    from router.replay import OpenAIReplay

    replay = OpenAIReplay(args.via, args.model, args.speed, lockstep=args.lockstep)
    bar = None if args.quiet else Progress(len(reqs), f"replay {args.replica_index + 1}/{args.replicas} "
                                                      f"{args.policy} via {args.via}")
    try:
        records = await replay.replay(reqs, bar.update if bar is not None else None, args.start_at)
    finally:
        await replay.close()
    if bar is not None:
        bar.close()
    if args.report:
        _write_report(args, records)
    return 0


async def _main(args: argparse.Namespace, workers: dict[str, str], reqs: list[Any] | None) -> int:
    if args.via:
        return await _replay_via(args, reqs or [])
    return await _replay_here(args, workers, reqs or [])


async def _replay_here(args: argparse.Namespace, workers: dict[str, str], reqs: list[Any]) -> int:
    """`--trace` without `--via`: an OpenAI router in this process (router/proxy/, the one users
    deploy: one decision path) on `--port` (an ephemeral loopback port with 0), the trace replayed
    through it as `--via` would; its `/health` adds the replay's progress."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    import httpx

    from router.progress import Progress
    from router.proxy.cmd import build_server
    from router.proxy.core import ProxyCore
    from router.replay import OpenAIReplay
    from router.simworker import fetch_sim
    from schemas.auth import read_token

    async with httpx.AsyncClient() as c:
        healths = await asyncio.gather(*(fetch_sim(c, u) for u in workers.values()))
    sizes = {h.block_size for h in healths}
    if len(sizes) != 1:
        print(f"kvatlas router: workers disagree on block size: {sorted(sizes)}", file=sys.stderr)
        return 2
    token = read_token(None, args.indexer_token_file, os.environ.get("KVATLAS_AUTH_TOKEN"))
    core = ProxyCore(workers, indexer=args.indexer, model=args.model, tokenizer=None, policy=args.policy,
                     sim=healths[0].sim, block_size=sizes.pop(), metrics_interval_s=args.metrics_interval,
                     seed=args.seed + args.replica_index, indexer_token=token,
                     admission_timeout_s=args.admission_timeout)
    state: dict[str, Any] = {"total": len(reqs), "done": 0, "replaying": True}
    core.extra_health = state
    await core.start()
    server, sock = build_server(core, args.host if args.port else "127.0.0.1", args.port,
                                max_body_bytes=int(args.max_body_mb * 1024 * 1024))
    port = sock.getsockname()[1]
    serve_task = asyncio.create_task(server.serve(sockets=[sock]))
    replay = OpenAIReplay(f"http://127.0.0.1:{port}", args.model, args.speed)
    try:
        while not server.started:
            if serve_task.done():
                return 1
            await asyncio.sleep(0.01)  # uvicorn's readiness has no event to await
        label = f"router {args.replica_index + 1}/{args.replicas} {args.policy}"
        bar = None if args.quiet else Progress(len(reqs), label)

        def on_done(n: int) -> None:
            state["done"] = n
            if bar is not None:
                bar.update(n)

        t0 = time.monotonic()
        records = await replay.replay(reqs, on_done, args.start_at)
        state["replaying"] = False
        if bar is not None:
            bar.close()
        log.info("replayed %d requests in %.1fs", len(records), time.monotonic() - t0)
        if args.report:
            _write_report(args, records)
        if not args.exit_after_replay and args.port:
            await serve_task
        return 0
    finally:
        await replay.close()
        server.should_exit = True
        await serve_task
        await core.close()
