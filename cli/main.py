"""`kvatlas` command line. Each subcommand lives in its own module, which exposes
`add_arguments(parser)` and `run(args) -> int`; this file only dispatches, so subcommands can be
added without touching each other."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> (module, one-line help). Modules keep heavy imports (FastAPI, torch) inside run(), so
# `kvatlas record` never pays for FastAPI and nothing here imports torch.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("router.cmd_demo", "run the end-to-end demo on embedded defaults"),
    "record": ("cli.record", "record live publishers into an event log"),
    "replay": ("cli.replay", "apply an event log offline or re-publish it over ZMQ"),
    "indexer": ("cli.indexer", "run the indexer service: ZMQ ingestion + HTTP API"),
    "relay": ("cli.relay", "bridge ZeroMQ publishers into NATS JetStream"),
    "worker": ("sim.cmd", "run a worker: simulated model over the tiered cache, KV events on ZMQ"),
    "router": ("router.cmd", "run the KV-aware OpenAI router, or replay a trace through it"),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvatlas")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvatlas", description="Exact, tier-aware KV-cache placement.")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument("--version", action="version", version=f"kvatlas {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_module=module_name)
        try:  # a missing optional dependency must not break the other subcommands
            importlib.import_module(module_name).add_arguments(sp)
        except ImportError as exc:
            sp.set_defaults(_import_error=exc)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    err = getattr(args, "_import_error", None)
    if err is not None:
        print(f"kvatlas {args.command}: cannot load ({err}); is the right extra installed?", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
