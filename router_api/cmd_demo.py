"""`kvatlas demo`: a producer fleet publishing real KV events into an in-process index, routed
round-robin and by kvatlas scores, with the index checked against the caches' truth.
The implementation lives in producer.demo (it runs torch caches); this module stays torch-free."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=4, help="number of workers (default 4)")
    p.add_argument("--requests", type=int, default=400, help="requests in the stream (default 400)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page/block (default 16)")
    p.add_argument("--device-pages", type=int, default=96, help="GPU-tier pages per worker (default 96)")
    p.add_argument("--host-pages", type=int, default=384, help="host-tier pages per worker (default 384)")
    p.add_argument("--seed", type=int, default=7)


def run(args: argparse.Namespace) -> int:
    try:
        from producer.demo import DemoConfig, main
    except ImportError as exc:
        raise SystemExit(f"kvatlas demo needs the producer extra (torch): {exc}") from None
    for name in ("workers", "requests", "page_size", "device_pages", "host_pages"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    cfg = DemoConfig(workers=args.workers, requests=args.requests, page_size=args.page_size,
                     device_pages=args.device_pages, host_pages=args.host_pages, seed=args.seed)
    return main(cfg)
