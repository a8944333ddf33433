"""`kvatlas worker`: one inference worker with a simulated model — real torch pools in a
`TieredCache`, KV events over ZeroMQ with replay, L3 on a local directory or a shared Redis, and
the HTTP API of `sim.app`. Registers itself with an indexer when given one.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

log = logging.getLogger("kvatlas.worker")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--id", dest="worker_id", default="worker-0", help="worker id (default worker-0)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="HTTP port (default 8100)")
    p.add_argument("--zmq-port", default="*", help="KV event PUB port (default: any free port)")
    p.add_argument("--replay-port", default="*", help="replay ROUTER port (default: any free port)")
    p.add_argument("--zmq-bind", default=None, help="address the ZMQ sockets bind (default: --host)")
    p.add_argument("--advertise-host", default=None,
                   help="host name the indexer reaches our ZMQ sockets at (default: the bound address)")
    p.add_argument("--indexer", default=None, help="indexer URL to register with, e.g. http://127.0.0.1:8700")
    p.add_argument("--indexer-token-file", default=None,
                   help="bearer token of an indexer run with auth (first line of the file; default $KVATLAS_AUTH_TOKEN)")
    p.add_argument("--register-interval", type=float, default=None, metavar="S",
                   help="seconds between checks that the indexer still knows this worker; one that forgot it "
                        "(restarted without a snapshot) gets the registration again (default 2)")
    p.add_argument("--model", default="default", help="model namespace at the indexer (default 'default')")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per page/block (default 16, the indexer's default)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the model's Hugging Face tokenizer directory: the OpenAI routes then take text "
                        "prompts and chat messages, tokenized as vLLM does")
    p.add_argument("--gpu-pages", type=int, default=320, help="GPU-tier pages (default 320)")
    p.add_argument("--host-pages", type=int, default=960, help="host-tier pages (default 960; 0 = none)")
    p.add_argument("--l3", choices=("none", "file", "redis", "mooncake"), default="none",
                   help="L3 backend (default none)")
    p.add_argument("--l3-dir", default=None, help="directory of the file L3 (node-local: events say DISK)")
    p.add_argument("--l3-config", default=None,
                   help="extra L3 backend options: inline JSON or @file (.json/.toml/.yaml); "
                        "redis: {\"url\": \"redis://host:6379/1\"}; mooncake: {\"master_server_address\": "
                        "\"host:50051\", \"metadata_server\": \"http://host:8080/metadata\"} (shared: events say EXTERNAL)")
    p.add_argument("--write-policy", default="write_through",
                   choices=("write_through", "write_through_selective", "write_back"))
    p.add_argument("--family", choices=("full", "mamba", "swa", "dsa"), default="full",
                   help="model family: full attention, a Mamba hybrid, a sliding-window hybrid or DSA (MLA + "
                        "indexer keys); hybrids publish vLLM's group events (docs/hybrid.md)")
    p.add_argument("--window", type=int, default=1024, help="swa: sliding window in tokens (default 1024)")
    p.add_argument("--chunk-tokens", type=int, default=4096,
                   help="mamba: prefill chunk; a state is kept at every chunk's end (default 4096)")
    p.add_argument("--mamba-states", type=int, default=0,
                   help="mamba: GPU Mamba state slots, their own pool with its own LRU (default: one per "
                        f"{MAMBA_TOKENS_PER_STATE:,} tokens of GPU KV, SGLang's sizing; docs/hybrid.md)")
    p.add_argument("--host-mamba-states", type=int, default=0,
                   help="mamba: host Mamba state slots (default: one per "
                        f"{MAMBA_TOKENS_PER_STATE:,} tokens of host KV)")
    p.add_argument("--swa-pages", type=int, default=0,
                   help="swa: GPU sliding-window pages, their own pool with its own LRU (default: "
                        f"{SWA_FULL_RATIO:g} x --gpu-pages, SGLang's swa_full_tokens_ratio)")
    p.add_argument("--host-swa-pages", type=int, default=0,
                   help=f"swa: host sliding-window pages (default: {SWA_FULL_RATIO:g} x --host-pages)")
    p.add_argument("--running-state-share", type=float, default=RUNNING_STATE_SHARE,
                   help="mamba: share of the GPU state pool a full batch of running requests holds, taken "
                        f"from the cached states (default {RUNNING_STATE_SHARE:g}, SGLang's: 3 slots per running "
                        "request, at most pool/5 running; 0 = off)")
    p.add_argument("--speed", type=float, default=1.0,
                   help="virtual seconds per wall second of the simulated model (default 1 = real time)")
    p.add_argument("--sim", default=None,
                   help="simulated model overrides as JSON, e.g. '{\"prefill_tokens_per_s\": 8000}'")


# Per-family defaults of the simulated model's hybrid costs (--sim overrides them): a Qwen3-Next-80B
# Mamba state (36 gated-delta-net layers: a 32 x 128 x 128 fp32 temporal state and a 8192 x 3 bf16
# conv state each, 73.7 MiB) and gpt-oss-like window layers.
MAMBA_STATE_BYTES = 36 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
FAMILY_SIM: dict[str, dict[str, int]] = {
    "mamba": {"mamba_state_bytes": MAMBA_STATE_BYTES},
    "swa": {"window_bytes_per_token": 131_072},
}

# Default pool sizes of the hybrid components (docs/hybrid.md, "Hybrid workers"), as SGLang sizes them.
# Mamba: SGLang gives the Mamba pool mamba_full_memory_ratio = 0.9 times the bytes of the KV pool; for
# Qwen3-Next-80B (the state above, 12 full-attention layers x 2 KV heads x 256 x K+V x bf16 = 24 KiB
# of KV per token) that is one state per MAMBA_STATE_BYTES / (0.9 x 24 KiB) ~ 3,493 tokens of KV.
MAMBA_TOKENS_PER_STATE = round(MAMBA_STATE_BYTES / (0.9 * 24_576))
# Sliding window: SGLang's SWA pool holds swa_full_tokens_ratio = 0.8 times the full pool's tokens.
SWA_FULL_RATIO = 0.8
# Running requests' working states share that pool (SGLang 0.5.23, Qwen3-Next's default extra_buffer
# strategy with the overlap scheduler): each holds a working slot and two tracking slots, and
# max_running_requests is capped at max_mamba_cache_size // 5, so a full batch holds 3/5 of the pool.
RUNNING_STATE_SHARE = 3 / 5


def _make_cache(args: argparse.Namespace, storage: Any, recorder: Any) -> Any:
    """The worker's cache: full attention as before; a hybrid family's pools with vLLM's group events."""
    transfer = "thread" if args.host_pages else None
    if args.family == "full":
        from sim.driver import build_cache

        return build_cache(page_size=args.block_size, device_pages=args.gpu_pages, host_pages=args.host_pages,
                           page_shape=(2, 4), transfer=transfer, storage=storage, recorder=recorder,
                           write_policy=args.write_policy)
    from producer.components.families import FamilySizes, build_family_cache

    pools: dict[str, Any] = pool_sizes(args)
    sizes = FamilySizes(page_size=args.block_size, device_pages=args.gpu_pages, host_pages=args.host_pages,
                        kv_shape=(2, 4), **pools, conv_shape=(2, 4), temporal_shape=(2, 4),
                        window=args.window, swa_shape=(2, 4), dsa_shape=(4,))
    return build_family_cache(args.family, sizes, transfer=transfer, storage=storage, recorder=recorder,
                              component_events=True, write_policy=args.write_policy)


def pool_sizes(args: argparse.Namespace) -> dict[str, int]:
    """The hybrid components' pools (FamilySizes fields): the options, else SGLang's sizing."""
    def states(pages: int) -> int:
        return max(1, pages * args.block_size // MAMBA_TOKENS_PER_STATE)

    return {"mamba_states": args.mamba_states or states(args.gpu_pages),
            "host_mamba_states": args.host_mamba_states or states(args.host_pages),
            "swa_device_pages": args.swa_pages or max(1, int(SWA_FULL_RATIO * args.gpu_pages)),
            "swa_host_pages": args.host_swa_pages or max(1, int(SWA_FULL_RATIO * args.host_pages))}


def indexer_token(path: str | None) -> str | None:
    """The indexer's bearer token: the file's first line, else $KVATLAS_AUTH_TOKEN, else None (the
    indexer's own rule, `schemas.auth.read_token`); an empty file stops the command."""
    from schemas.auth import read_token

    try:
        return read_token(None, path, os.environ.get("KVATLAS_AUTH_TOKEN"))
    except ValueError as exc:
        raise SystemExit(f"kvatlas: {exc}") from None


def _endpoint(bind: str, port: str) -> str:
    return f"tcp://{bind}:{port}"


def _advertised(bound: str, host: str | None) -> str:
    if not host:
        return bound.replace("0.0.0.0", "127.0.0.1")
    port = bound.rsplit(":", 1)[1]
    return f"tcp://{host}:{port}"


def http_url(host: str, port: int, advertise_host: str | None) -> str:
    """The worker's OpenAI-compatible base URL as routers reach it (RegisterWorker.url)."""
    h = advertise_host or ("127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host)
    return f"http://[{h}]:{port}" if ":" in h else f"http://{h}:{port}"


def server_config(app: Any, host: str, port: int, limits: Any = None) -> Any:
    """The worker's uvicorn settings: idle connections close after WORKER_KEEPALIVE_S, later than
    the routers' clients drop theirs (sim.httpbody)."""
    import uvicorn

    from sim.app import HttpLimits
    from sim.httpbody import WORKER_KEEPALIVE_S

    # a request deadline and a connection cap (sim/app.py HttpLimits)
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                          timeout_keep_alive=int(WORKER_KEEPALIVE_S),
                          http=(limits if limits is not None else HttpLimits()).protocol())


def run(args: argparse.Namespace) -> int:
    import msgspec
    import uvicorn

    from producer.events import EventRecorder
    from producer.publisher import ZmqEventPublisher
    from producer.sinks import ZmqSink
    from producer.storage.config import load_backend_config, make_storage_backend
    from producer.storage.worker import StorageWorker
    from sim.app import create_worker_app
    from sim.engine import Engine, VirtualClock
    from sim.api import SimModel, WorkerHealth
    from sim.registrar import REGISTER_INTERVAL_S, Registrar, RegistrationRefused

    for name in ("block_size", "gpu_pages", "port"):
        if getattr(args, name) <= 0:
            print(f"kvatlas worker: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    if args.register_interval is not None and not 0 < args.register_interval <= 3600:
        print("kvatlas worker: --register-interval must be within (0, 3600] seconds", file=sys.stderr)
        return 2
    if args.host_pages < 0 or args.speed <= 0:
        print("kvatlas worker: --host-pages must be >= 0 and --speed positive", file=sys.stderr)
        return 2
    pools = ("mamba_states", "host_mamba_states", "swa_pages", "host_swa_pages")
    if (args.window <= 0 or args.chunk_tokens < args.block_size or any(getattr(args, n) < 0 for n in pools)
            or not 0.0 <= args.running_state_share < 1.0):
        print("kvatlas worker: --window must be positive, --chunk-tokens at least --block-size, "
              "--mamba-states, --host-mamba-states, --swa-pages and --host-swa-pages >= 0, "
              "--running-state-share in [0, 1)", file=sys.stderr)
        return 2
    try:
        over = msgspec.json.decode(args.sim or "{}")
        if not isinstance(over, dict):
            raise ValueError("--sim must be a JSON object")
        sim = msgspec.convert({**FAMILY_SIM.get(args.family, {}), **over}, type=SimModel)
        l3cfg = load_backend_config(args.l3_config) if args.l3 != "none" else {}
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        print(f"kvatlas worker: bad configuration: {exc}", file=sys.stderr)
        return 2
    tokenizer = None
    if args.tokenizer:
        from router_api.tokenization import ChatTokenizer, TokenizerError

        try:
            tokenizer = ChatTokenizer.from_dir(args.tokenizer, name=args.model)
        except TokenizerError as exc:
            print(f"kvatlas worker: bad --tokenizer: {exc}", file=sys.stderr)
            return 2
    if args.l3 != "none" and not args.host_pages:
        print("kvatlas worker: an L3 needs a host tier (--host-pages > 0)", file=sys.stderr)
        return 2
    storage = probe = None
    try:
        if args.l3 == "file":
            if not args.l3_dir:
                print("kvatlas worker: --l3 file needs --l3-dir", file=sys.stderr)
                return 2
            storage = StorageWorker(make_storage_backend("file", {"root": args.l3_dir, **l3cfg}))
        elif args.l3 == "redis":
            storage = StorageWorker(make_storage_backend("redis", l3cfg))
            if storage.backend.shared:
                probe = make_storage_backend("redis", {**l3cfg, "track_keys": False})
        elif args.l3 == "mooncake":
            storage = StorageWorker(make_storage_backend("mooncake", l3cfg))
            probe = storage.backend  # thread-safe: one Mooncake client (one segment) per worker
            storage.submit_exists([])  # the client connects on the storage thread now, not on a first request
    except ValueError as exc:
        print(f"kvatlas worker: bad L3 configuration: {exc}", file=sys.stderr)
        return 2

    bind = args.zmq_bind or args.host
    publisher = ZmqEventPublisher(_endpoint(bind, args.zmq_port),
                                  replay_endpoint=_endpoint(bind, args.replay_port))
    recorder = EventRecorder(ZmqSink(publisher), heartbeat_interval_s=1.0)
    cache = _make_cache(args, storage, recorder)
    engine = Engine(cache, sim, probe=probe, chunk_pages=args.chunk_tokens // args.block_size,
                    running_state_share=args.running_state_share if args.family == "mamba" else 0.0)
    endpoint = _advertised(publisher.endpoint, args.advertise_host)
    replay = None if publisher.replay_endpoint is None else _advertised(publisher.replay_endpoint, args.advertise_host)
    health = WorkerHealth(status="ok", worker_id=args.worker_id, model=args.model, block_size=args.block_size,
                          endpoint=endpoint, replay_endpoint=replay, sim=sim,
                          l3=None if storage is None else ("shared" if storage.backend.shared else "disk"),
                          family=args.family)
    log.info("worker %s (%s): events on %s (replay %s), GPU %d + host %d pages of %d tokens, L3 %s",
             args.worker_id, args.family, endpoint, replay, args.gpu_pages, args.host_pages, args.block_size,
             health.l3)
    def events_seq() -> int | None:
        publisher.flush(5.0)  # what the recorder handed over is sent (a seq each)
        return publisher.next_seq - 1 if publisher.next_seq else None

    app = create_worker_app(engine, health, VirtualClock(args.speed), tokenizer, events_seq=events_seq)
    registrar = None
    try:
        if args.indexer:
            registrar = Registrar(args.indexer, {
                "worker_id": args.worker_id, "endpoint": endpoint, "replay_endpoint": replay, "model": args.model,
                "block_size": args.block_size, "url": http_url(args.host, args.port, args.advertise_host),
            }, token=indexer_token(args.indexer_token_file), interval_s=args.register_interval or REGISTER_INTERVAL_S)
            try:
                registrar.register()
            except RegistrationRefused as exc:
                raise SystemExit(f"kvatlas worker: the indexer refused the registration: {exc}") from None
            except OSError as exc:
                raise SystemExit(f"kvatlas worker: indexer {args.indexer} unreachable: {exc}") from None
            registrar.start()
        uvicorn.Server(server_config(app, args.host, args.port, app.state.limits)).run()
    finally:
        if registrar is not None:
            registrar.close()
        engine.close()
        recorder.close(time.monotonic())
        if cache.transfer is not None:
            cache.transfer.close()
        if storage is not None:
            storage.close()
        if probe is not None:
            probe.close()
    return 0
