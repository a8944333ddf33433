"""`kvatlas router` in OpenAI mode (the default without `--trace`): serve the proxy until stopped.

Workers come from `--worker ID=URL` flags and, with `--indexer`, from the indexer's registry
(`GET /workers` rows that carry a `url`), re-read every `--workers-interval` seconds; a flag names
the URL of its id whatever the registry says. The server is uvicorn with the router's own
httptools protocol (router/proxy/front.py: the two routed paths answered without ASGI), built on
the indexer's guarded one (router_api/fasthttp.py): a deadline for each request's head and body and
a cap on open connections. `--reuse-port` lets several router processes share one port (SO_REUSEPORT:
the kernel spreads connections over them; docs/openai.md, "Scaling out")."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from typing import Any, Callable

import httpx
import msgspec

log = logging.getLogger("kvatlas.router")


def run(args: argparse.Namespace, workers: dict[str, str]) -> int:
    from schemas.auth import read_token
    from router_api.tokenization import TokenizerError, load_tokenizer_specs
    from schemas.costmodel import SimModel

    try:
        tokenizers = load_tokenizer_specs(args.tokenizer or [], args.model)
        if args.tokenizer and args.model not in tokenizers:
            raise ValueError(f"no --tokenizer for the routed model {args.model!r} "
                             f"(given: {', '.join(sorted(tokenizers.by_model))})")
        sim = msgspec.json.decode(args.sim or "{}", type=SimModel)
        token = read_token(None, args.indexer_token_file, os.environ.get("KVATLAS_AUTH_TOKEN"))
        if args.metrics_interval <= 0 or args.block_size <= 0 or args.first_byte_timeout <= 0:
            raise ValueError("--metrics-interval, --block-size and --first-byte-timeout must be positive")
        if not 0 <= args.decision_log_rate <= 1:
            raise ValueError("--decision-log-rate must be within [0, 1]")
        if not workers and not args.indexer:
            raise ValueError("give --worker ID=URL, or --indexer URL to learn the workers from its registry")
    except (ValueError, OSError, TokenizerError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        print(f"kvatlas router: {exc}", file=sys.stderr)
        return 2
    tokenizer = tokenizers.by_model.get(args.model)
    if tokenizer is None:
        log.warning("event=no_tokenizer detail=text prompts and chats are routed on load only; "
                    "give --tokenizer DIR (the model's Hugging Face tokenizer directory)")
    if not args.indexer:
        log.warning("event=no_indexer detail=routing on load only; give --indexer URL for KV-aware routing")
    runner: Callable[..., Any] = asyncio.run
    try:  # uvloop: the round trips to the indexer and the engines cost about half
        import uvloop

        runner = uvloop.run
    except ImportError:
        pass
    return int(runner(_serve(args, workers, tokenizer, sim, token)))


async def learn_workers(core: object, indexer: str, token: str | None, flags: dict[str, str],
                        client: httpx.AsyncClient) -> int:
    """Add the registry's workers that carry a URL (flags win); returns how many are new."""
    from router.proxy.core import ProxyCore

    assert isinstance(core, ProxyCore)
    try:
        r = await client.get(f"{indexer.rstrip('/')}/workers", timeout=5.0,
                             headers={"Authorization": f"Bearer {token}"} if token else None)
        rows = msgspec.json.decode(r.content).get("workers", []) if r.status_code == 200 else []
    except (httpx.HTTPError, msgspec.DecodeError, AttributeError):
        return 0
    new = 0
    for row in rows:
        wid, url = row.get("worker_id"), row.get("url")
        if not isinstance(wid, str) or not isinstance(url, str) or wid in flags:
            continue
        if not url.startswith(("http://", "https://")):
            continue
        if core.workers.get(wid) != url.rstrip("/"):
            core.add_worker(wid, url.rstrip("/"), row.get("model") if isinstance(row.get("model"), str) else None)
            log.info("event=worker_learned worker=%s url=%s model=%s", wid, url, row.get("model"))
            new += 1
    return new


async def _learn_loop(core: object, args: argparse.Namespace, token: str | None, flags: dict[str, str]) -> None:
    async with httpx.AsyncClient() as client:
        while True:
            await learn_workers(core, args.indexer, token, flags, client)
            await asyncio.sleep(args.workers_interval)  # the registry is re-read on a period


def build_server(core: object, host: str, port: int, *, max_body_bytes: int, request_timeout_s: float = 10.0,
                 max_connections: int = 1024, reuse_port: bool = False) -> tuple[Any, socket.socket]:
    """The proxy's uvicorn server and its bound socket (serve with `server.serve(sockets=[sock])`)."""
    import uvicorn

    from router.proxy.app import create_proxy_app
    from router.proxy.core import ProxyCore
    from router.proxy.front import proxy_protocol_class

    assert isinstance(core, ProxyCore)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    config = uvicorn.Config(create_proxy_app(core, max_body_bytes), log_level="warning", access_log=False,
                            lifespan="off", http=proxy_protocol_class(core, max_body_bytes, request_timeout_s,
                                                                      max_connections))
    return uvicorn.Server(config), sock


async def _serve(args: argparse.Namespace, workers: dict[str, str], tokenizer: object, sim: object,
                 token: str | None) -> int:
    from router.proxy.core import ProxyCore

    logging.getLogger("httpx").setLevel(logging.WARNING)
    core = ProxyCore(workers, indexer=args.indexer, model=args.model, tokenizer=tokenizer,  # type: ignore[arg-type]
                     policy=args.policy, sim=sim, block_size=args.block_size,  # type: ignore[arg-type]
                     metrics_interval_s=args.metrics_interval, forward_token_ids=args.forward_token_ids,
                     seed=args.seed, indexer_token=token, first_byte_timeout_s=args.first_byte_timeout,
                     admission_timeout_s=args.admission_timeout, decision_log_rate=args.decision_log_rate,
                     lockstep=getattr(args, "lockstep", False))
    learner = None
    if args.indexer and args.workers_interval > 0:
        async with httpx.AsyncClient() as c:
            await learn_workers(core, args.indexer, token, workers, c)
        learner = asyncio.get_running_loop().create_task(_learn_loop(core, args, token, workers))
    await core.start()
    for w, st in core.poller.states.items():
        log.info("event=worker worker=%s url=%s up=%s reason=%s", w, st.url, st.up, st.reason)
    server, sock = build_server(core, args.host, args.port, max_body_bytes=int(args.max_body_mb * 1024 * 1024),
                                request_timeout_s=args.request_timeout, max_connections=args.max_connections,
                                reuse_port=args.reuse_port)
    log.info("event=listening url=http://%s:%d api=openai policy=%s", args.host, args.port, args.policy)
    try:
        await server.serve(sockets=[sock])
    finally:
        if learner is not None:
            learner.cancel()
        await core.close()
    return 0
