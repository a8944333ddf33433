"""`kvatlas router` in OpenAI mode (the default without `--trace`): serve the proxy until stopped."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

log = logging.getLogger("kvatlas.router")


def run(args: argparse.Namespace, workers: dict[str, str]) -> int:
    import msgspec

    from sim.api import SimModel
    from schemas.auth import read_token
    from router_api.tokenization import TokenizerError, load_tokenizer_specs

    try:
        tokenizers = load_tokenizer_specs(args.tokenizer or [], args.model)
        if args.tokenizer and args.model not in tokenizers:
            raise ValueError(f"no --tokenizer for the routed model {args.model!r} "
                             f"(given: {', '.join(sorted(tokenizers.by_model))})")
        sim = msgspec.json.decode(args.sim or "{}", type=SimModel)
        token = read_token(None, args.indexer_token_file, os.environ.get("KVATLAS_AUTH_TOKEN"))
        if args.metrics_interval <= 0 or args.block_size <= 0:
            raise ValueError("--metrics-interval and --block-size must be positive")
    except (ValueError, OSError, TokenizerError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        print(f"kvatlas router: {exc}", file=sys.stderr)
        return 2
    tokenizer = tokenizers.by_model.get(args.model)
    if tokenizer is None:
        log.warning("event=no_tokenizer detail=text prompts and chats are routed on load only; "
                    "give --tokenizer DIR (the model's Hugging Face tokenizer directory)")
    if not args.indexer:
        log.warning("event=no_indexer detail=routing on load only; give --indexer URL for KV-aware routing")
    try:  # uvloop: httpx's round trips to the indexer and the engines cost about half (bench/bench_openai.py)
        import uvloop

        runner = getattr(uvloop, "run", asyncio.run)
    except ImportError:
        runner = asyncio.run
    return int(runner(_serve(args, workers, tokenizer, sim, token)))


async def _serve(args: argparse.Namespace, workers: dict[str, str], tokenizer: object, sim: object,
                 token: str | None) -> int:
    import uvicorn

    from router_api.proxy.app import create_proxy_app
    from router_api.proxy.core import ProxyCore

    logging.getLogger("httpx").setLevel(logging.WARNING)
    core = ProxyCore(workers, indexer=args.indexer, model=args.model, tokenizer=tokenizer,  # type: ignore[arg-type]
                     policy=args.policy, sim=sim, block_size=args.block_size,  # type: ignore[arg-type]
                     metrics_interval_s=args.metrics_interval, forward_token_ids=args.forward_token_ids,
                     seed=args.seed, indexer_token=token)
    await core.start()
    for w, st in core.poller.states.items():
        log.info("event=worker worker=%s url=%s up=%s reason=%s", w, st.url, st.up, st.reason)
    server = uvicorn.Server(uvicorn.Config(create_proxy_app(core, int(args.max_body_mb * 1024 * 1024)), host=args.host, port=args.port,
                                           log_level="warning", access_log=False, lifespan="off"))
    log.info("event=listening url=http://%s:%d api=openai policy=%s", args.host, args.port, args.policy)
    try:
        await server.serve()
    finally:
        await core.close()
    return 0
