"""`kvatlas indexer`: ingestion from every registered worker plus the HTTP API, in one process.

Settings come from flags, else from `--config FILE` (.json/.toml; keys are the long flag names
with underscores, plus `workers: [{worker_id, endpoint, ...}]`), else from the defaults below.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

from schemas.auth import read_token

DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 8700,
    "model": "default",
    "block_size": 16,
    "snapshot": None,
    "snapshot_key": "kvatlas:snapshot",
    "snapshot_interval": 30.0,
    "auth_token": None,
    "auth_token_file": None,
    "max_workers": 1024,
    "max_models": 256,
    "max_msg_mb": 64.0,
    "replay_deadline": None,
    "snapshot_load_timeout": 10.0,
    "tier_weights": None,
    "stale_after": 10.0,
    "remove_after": 300.0,
    "silent_factor": 6.0,
    "resync_hold": 30.0,
    "max_body_mb": 8.0,
    "replay_timeout": 2.0,
    "ingest_shards": "auto",
    "log_format": "text",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="JSON or TOML file with any of these settings (flags win)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8700; 0 picks a free one)")
    p.add_argument("--model", help="default model namespace (default 'default')")
    p.add_argument("--block-size", type=int, help="block size of the default model (default 16)")
    p.add_argument("--worker", action="append", default=[], metavar="SPEC",
                   help="static worker: ID=tcp://h:p[,replay=tcp://h:p][,dp=N][,topic=T][,model=M]"
                        "[,block_size=B] (repeatable)")
    p.add_argument("--tokenizer", action="append", default=[], metavar="MODEL=DIR",
                   help="a model's Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json): "
                        "/score then takes 'prompt' or chat 'messages' for it (repeatable)")
    p.add_argument("--snapshot", help="snapshot target: redis://host:port/db or a file path (default: none, in-memory)")
    p.add_argument("--snapshot-key", help="Redis key of the snapshot (default kvatlas:snapshot)")
    p.add_argument("--snapshot-interval", type=float, help="seconds between snapshots (default 30)")
    p.add_argument("--auth-token", help="require 'Authorization: Bearer TOKEN' on every endpoint but /health "
                                        "(visible in ps: prefer --auth-token-file or $KVATLAS_AUTH_TOKEN)")
    p.add_argument("--auth-token-file", help="read the bearer token from this file (first line, stripped)")
    p.add_argument("--max-workers", type=int, help="registration cap; past it POST /workers answers 503 (default 1024)")
    p.add_argument("--max-models", type=int, help="models indexed at once; a registration of one more answers 503 "
                   "(default 256; a model goes when its last worker does)")
    p.add_argument("--max-msg-mb", type=float,
                   help="largest ZMQ message accepted on SUB and replay sockets, MiB (default 64)")
    p.add_argument("--replay-deadline", type=float,
                   help="seconds a whole replay may take (default 5 x --replay-timeout)")
    p.add_argument("--snapshot-load-timeout", type=float,
                   help="seconds to keep retrying an unreachable snapshot store at start before refusing "
                        "to start (default 10)")
    p.add_argument("--tier-weights", help="score weight per tier, e.g. gpu=1,host=0.8,disk=0.5,shared=0.3")
    p.add_argument("--stale-after", type=float, help="seconds of silence before a heartbeating worker is stale (default 10)")
    p.add_argument("--remove-after", type=float, help="seconds of silence before it is removed (default 300)")
    p.add_argument("--silent-factor", type=float,
                   help="engines that never heartbeat are stale after stale-after × this, never removed (default 6)")
    p.add_argument("--pending-ttl", type=float, default=None,
                   help="seconds an in-flight route (POST /routes) counts as pending_blocks when neither the "
                        "worker's events nor a release end it first (default 10)")
    p.add_argument("--route-admit-timeout", type=float, default=None,
                   help="seconds a route reported with admits holds later routes back (their `after`) when its "
                        "admission is not reported (default 1)")
    p.add_argument("--resync-hold", type=float, help="seconds a resynced worker is reported 'resyncing' (default 30)")
    p.add_argument("--max-body-mb", type=float, help="request body limit in MiB; larger bodies get 413 (default 8)")
    p.add_argument("--replay-timeout", type=float, help="seconds to wait for a publisher's replay (default 2)")
    p.add_argument("--ingest-shards", type=_shards_arg, metavar="N",
                   help="ingest pipelines, each with its own thread, sockets and index shard (workers split by "
                        f"id); >1 uses that many cores for ingestion; not with --nats or trust_engine_hashes "
                        f"(default auto: the usable CPUs, at most {AUTO_SHARDS_CAP}; 1 with --nats)")
    p.add_argument("--http-request-timeout", type=float, metavar="S",
                   help="a request must arrive whole (headers and body) within S seconds of its first byte, "
                        "else 408 and the connection is closed (default 10)")
    p.add_argument("--http-max-connections", type=int, metavar="N",
                   help="open HTTP connections at most; one more is answered 503 and closed (default 1024, or half "
                        "the open-file limit when that is lower)")
    p.add_argument("--http-fast-path", choices=("on", "off"),
                   help="answer /score and /query in uvicorn's protocol callbacks (default on; off: through "
                        "the ASGI front, for comparison)")
    p.add_argument("--http-offload-bytes", type=int, metavar="N",
                   help="/score and /query bodies of at least N bytes are answered on a worker thread, off the "
                        "event loop (default 262144; 0: every body on the loop, for comparison; docs/limits.md)")
    p.add_argument("--log-format", choices=("text", "json"), help="log line format (default text)")
    # The JetStream event plane (docs/jetstream.md); the logic lives in router_api.nats_plane.
    p.add_argument("--nats", metavar="URL", help="consume every worker of the shared registry from NATS JetStream")
    p.add_argument("--nats-stream", default="KVATLAS_EVENTS", help="JetStream events stream (default KVATLAS_EVENTS)")
    p.add_argument("--nats-registry-bucket", default="kvatlas_workers",
                   help="KV bucket of the shared registry (default kvatlas_workers)")
    p.add_argument("--nats-per-worker", action="store_true",
                   help="one ordered consumer per worker instead of one shared consumer per replica")


# `auto` takes at most this many pipelines: past it each extra one adds a thread and a shard that every
# /score merges, while a 2-8 core box already drains faster than one publisher fleet fills (docs/service.md).
AUTO_SHARDS_CAP = 8


def _shards_arg(text: str) -> int | str:
    """`--ingest-shards`: an integer (range-checked by ServiceConfig) or `auto`."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a container's cpuset), else the CPU count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def resolve_ingest_shards(value: object, *, nats: bool, trust_engine_hashes: bool = False,
                          cpus: int | None = None) -> tuple[Any, str]:
    """The ingest pipeline count and why: `auto` (the default) is one pipeline per usable CPU, at most
    AUTO_SHARDS_CAP, and 1 where shards are refused (the NATS plane, trust mode). Anything else is
    returned as given (ServiceConfig and `run` check it, so an explicit value is never overridden)."""
    if value != "auto":
        return value, "flag"
    if nats:
        return 1, "auto_nats"
    if trust_engine_hashes:
        return 1, "auto_trust"
    return max(1, min(cpus if cpus is not None else usable_cpus(), AUTO_SHARDS_CAP)), "auto_cpus"


def parse_worker_spec(spec: str) -> dict[str, Any]:
    """`w1=tcp://h:p,replay=tcp://h:q,dp=0,url=http://h:8000` -> registration fields."""
    head, _, rest = spec.partition(",")
    wid, sep, endpoint = head.partition("=")
    if not sep or not wid or not endpoint:
        raise ValueError(f"worker spec {spec!r}: expected ID=ENDPOINT[,key=value...]")
    out: dict[str, Any] = {"worker_id": wid.strip(), "endpoint": endpoint.strip()}
    names = {"replay": "replay_endpoint", "replay_endpoint": "replay_endpoint", "dp": "dp_rank",
             "dp_rank": "dp_rank", "topic": "topic", "model": "model", "block_size": "block_size",
             "url": "url"}
    for item in filter(None, rest.split(",")):
        k, sep, v = item.partition("=")
        key = names.get(k.strip())
        if not sep or key is None:
            raise ValueError(f"worker spec {spec!r}: unknown option {k!r} (known: {sorted(names)})")
        out[key] = int(v) if key in ("dp_rank", "block_size") else v.strip()
    return out


def parse_tier_weights(text: str | dict | None) -> dict[str, float] | None:
    if not text:
        return None
    if isinstance(text, dict):
        return {str(k): float(v) for k, v in text.items()}
    out: dict[str, float] = {}
    for item in text.split(","):
        k, sep, v = item.partition("=")
        if not sep:
            raise ValueError(f"tier weights {text!r}: expected tier=weight,...")
        out[k.strip()] = float(v)
    return out


def load_config(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".toml"):
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib
        data = tomllib.loads(raw.decode())
    else:
        data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError(f"config {path}: top level must be a table/object")
    return {k.replace("-", "_"): v for k, v in data.items()}


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line; `event=x key=y` messages are split into fields."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        out: dict[str, Any] = {"ts": round(record.created, 6), "level": record.levelname, "logger": record.name}
        fields: dict[str, str] = {}
        for tok in msg.split(" "):
            k, sep, v = tok.partition("=")
            if not sep or not k.isidentifier():
                fields = {}
                break
            fields[k] = v
        if fields:
            out.update(fields)
        else:
            out["msg"] = msg
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def build_config(args: argparse.Namespace) -> Any:
    from router_api.config import ServiceConfig
    from schemas.api import RegisterWorker
    import msgspec

    file_cfg = load_config(getattr(args, "config", None))

    def get(name: str) -> Any:
        v = getattr(args, name, None)
        if v is not None:
            return v
        return file_cfg.get(name, DEFAULTS.get(name))

    specs = [parse_worker_spec(s) for s in (getattr(args, "worker", None) or [])]
    specs += list(file_cfg.get("workers", []))
    model = get("model")
    block_size = int(get("block_size"))
    workers = []
    sizes = {model: (block_size, "--block-size")}
    for s in specs:
        s = dict(s)
        s.setdefault("model", model)
        s.setdefault("block_size", block_size if s["model"] == model else 16)
        w = msgspec.convert(s, RegisterWorker)
        # refused here, before anything starts, as POST /workers would refuse it (registry.ConflictingBlockSize)
        fixed = sizes.setdefault(w.model, (w.block_size, f"worker {w.worker_id!r}"))
        if fixed[0] != w.block_size:
            raise ValueError(f"worker {w.worker_id!r}: block_size {w.block_size} conflicts with model {w.model!r}, "
                             f"which uses {fixed[0]} (from {fixed[1]})")
        workers.append(w)
    token = read_token(get("auth_token"), get("auth_token_file"), os.environ.get("KVATLAS_AUTH_TOKEN"))
    deadline = get("replay_deadline")
    shards, why = resolve_ingest_shards(get("ingest_shards"), nats=bool(getattr(args, "nats", None)))
    if why != "flag":
        logging.getLogger("kvatlas.indexer").info("event=ingest_shards n=%s source=%s cpus=%d", shards, why,
                                                  usable_cpus())
    return ServiceConfig(
        host=get("host"), port=int(get("port")), model=model, block_size=block_size,
        static_workers=workers, snapshot_target=get("snapshot"), snapshot_key=get("snapshot_key"),
        snapshot_interval_s=float(get("snapshot_interval")), auth_token=token,
        tier_weights=parse_tier_weights(get("tier_weights")), stale_after_s=float(get("stale_after")),
        remove_after_s=float(get("remove_after")), silent_engine_factor=float(get("silent_factor")),
        resync_hold_s=float(get("resync_hold")), max_body_bytes=int(float(get("max_body_mb")) * 1024 * 1024),
        replay_timeout_s=float(get("replay_timeout")), max_workers=int(get("max_workers")),
        max_models=int(get("max_models")),
        max_msg_bytes=int(float(get("max_msg_mb")) * 1024 * 1024),
        replay_deadline_s=None if deadline is None else float(deadline),
        snapshot_load_timeout_s=float(get("snapshot_load_timeout")),
        ingest_shards=shards,  # checked by ServiceConfig (an integer, 1..64)
        tokenizers=_tokenizers(getattr(args, "tokenizer", None) or file_cfg.get("tokenizer") or [], model),
    )


def _tokenizers(specs: list[str] | dict[str, str], model: str) -> Any:
    """`--tokenizer MODEL=DIR` values (or a config file's {model: dir}) loaded; ValueError names the bad one."""
    if not specs:
        return None
    from router_api.tokenization import load_tokenizer_specs

    if isinstance(specs, dict):
        specs = [f"{m}={d}" for m, d in specs.items()]
    return load_tokenizer_specs(list(specs), model)


class SafeTextFormatter(logging.Formatter):
    """The text log format with control characters in messages escaped, so a value sent by a
    client (a path, a name) cannot start a forged log line."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        return line if line.isprintable() else line.encode("unicode_escape").decode("ascii")


def default_max_connections(cap: int = 1024) -> int:
    """The HTTP connection cap when none is given: 1024, or half the open-file limit when that is
    lower (the rest is for ZeroMQ sockets, snapshots and logs), so the cap is hit before EMFILE."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return cap
    return max(16, min(cap, soft // 2))


def server_settings(host: str, port: int, fast_path: bool = True, request_timeout_s: float = 10.0,
                    max_connections: int = 1024) -> dict[str, Any]:
    """uvicorn settings for the indexer (measured choices, docs/service.md "HTTP stack"): the
    httptools parser with the /score and /query fast path (`router_api.fasthttp`) and uvloop
    (named, so a missing one fails loudly instead of silently serving at half speed), no access
    log, no proxy-header rewriting (nothing here reads the client address, and it is a
    per-request pass over the headers), no `server` header, and keep-alive long enough that a
    router's connection is reused between its queries. A request must arrive whole within
    `request_timeout_s`, and at most `max_connections` are open at once (docs/limits.md)."""
    from router_api import fasthttp

    if fasthttp.supported():
        http: Any = fasthttp.protocol_class(fast_path, request_timeout_s, max_connections)
    else:  # this uvicorn lacks the hooks: its own limits only (keep-alive timeout), no deadline or cap
        http = "httptools"
    return {"host": host, "port": port, "http": http, "loop": "uvloop", "log_level": "warning",
            "access_log": False, "proxy_headers": False, "server_header": False, "lifespan": "off",
            "timeout_keep_alive": 30}


def _make_server(uvicorn: Any, config: Any) -> Any:
    import contextlib
    import signal
    import threading

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT once it has stopped serving, which would kill us before
        the final snapshot; we take the same signals, stop serving, and return normally instead."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    return Server(config)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from router_api.app import create_app
    from router_api.service import IndexerService

    try:
        config = build_config(args)
    except (ValueError, OSError, TypeError) as exc:
        print(f"kvatlas indexer: bad configuration: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # msgspec.ValidationError for a bad static worker
        print(f"kvatlas indexer: bad configuration: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "nats", None) and config.ingest_shards > 1:
        # The plane makes one JetStream consumer per replica (router_api/nats_plane.py), not one per pipeline.
        print("kvatlas indexer: bad configuration: --ingest-shards > 1 cannot be combined with --nats",
              file=sys.stderr)
        return 2
    fmt = getattr(args, "log_format", None) or DEFAULTS["log_format"]
    for h in logging.getLogger().handlers:
        h.setFormatter(JsonLogFormatter() if fmt == "json" else
                       SafeTextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("kvatlas.indexer")
    # Short GIL slices keep /score latency low while the ingest thread is busy.
    sys.setswitchinterval(0.001)
    if getattr(args, "auth_token", None):
        log.warning("event=auth_token_on_command_line hint=visible_in_ps_use_--auth-token-file_or_KVATLAS_AUTH_TOKEN")
    plane = None
    if getattr(args, "nats", None):
        from router_api.nats_plane import plane_from_args

        try:
            plane = plane_from_args(args)
        except Exception as exc:  # NatsUnavailable names the URL
            print(f"kvatlas indexer: {exc}", file=sys.stderr)
            return 2
    try:
        from indexer.pending import PendingRoutes

        ttl = getattr(args, "pending_ttl", None)
        admit = getattr(args, "route_admit_timeout", None)
        pending_kw = {k: v for k, v in (("ttl_s", ttl), ("admit_timeout_s", admit)) if v is not None}
        service = IndexerService(config, subscriber_factory=None if plane is None else
                                 plane.subscriber_factory(config.replay_timeout_s),
                                 pending=PendingRoutes(**pending_kw) if pending_kw else None)
    except ValueError as exc:  # e.g. stale-after > remove-after, bad snapshot target
        print(f"kvatlas indexer: bad configuration: {exc}", file=sys.stderr)
        if plane is not None:
            plane.close()
        return 2
    service.plane = plane
    if service.core != "native":
        # Loud on purpose: the pure-Python core ingests and scores several times slower (docs/service.md).
        banner = ("kvatlas indexer: WARNING: the C accelerator (indexer/_native) is not in use; running the "
                  "pure-Python index core, several times slower. Rebuild with `pip install -e .` (needs a C "
                  "compiler) or unset KVATLAS_PURE_PYTHON. /health and /metrics report core=python.")
        print(banner, file=sys.stderr, flush=True)
        log.warning("event=slow_core core=python")
    from indexer.snapshot import SnapshotError

    try:
        service.start()
    except SnapshotError as exc:  # docs/service.md, "Snapshots": never start over an unread snapshot
        print(f"kvatlas indexer: refusing to start: {exc}", file=sys.stderr)
        if plane is not None:
            plane.close()
        return 1
    if plane is not None:
        plane.attach(service)  # follow the shared registry
        from router_api.route_plane import RouteFanout

        service.route_fanout = RouteFanout(plane.nats, service)  # pending routes reach every replica
    from router_api.offload import OFFLOAD_MIN_BYTES, AnswerPool

    offload = getattr(args, "http_offload_bytes", None)
    if offload is not None and offload < 0:
        print("kvatlas indexer: --http-offload-bytes must be >= 0", file=sys.stderr)
        service.stop(final_snapshot=False)
        if plane is not None:
            plane.close()
        return 2
    pool = AnswerPool(OFFLOAD_MIN_BYTES if offload is None else offload)
    app = create_app(service, pool=pool)
    # Everything imported and built so far lives as long as the process: keep it out of the
    # collector's full passes, which would otherwise walk it during /score requests (p99).
    import gc

    gc.collect()
    gc.freeze()
    fast = (getattr(args, "http_fast_path", None) or "on") == "on"
    timeout = getattr(args, "http_request_timeout", None) or 10.0
    max_conn = getattr(args, "http_max_connections", None) or default_max_connections()
    if timeout <= 0 or max_conn < 1:
        print("kvatlas indexer: --http-request-timeout must be > 0 and --http-max-connections >= 1", file=sys.stderr)
        service.stop(final_snapshot=False)
        if plane is not None:
            plane.close()
        return 2
    server = _make_server(uvicorn, uvicorn.Config(app, **server_settings(config.host, config.port, fast, timeout,
                                                                         max_conn)))
    t0 = time.monotonic()
    log.info("event=listening url=http://%s:%d", config.host, config.port)
    try:
        server.run()  # returns on SIGINT/SIGTERM
    finally:
        log.info("event=shutting_down served_s=%.1f", time.monotonic() - t0)
        pool.close()
        service.stop()
        if service.route_fanout is not None:
            service.route_fanout.close()
        if plane is not None:
            plane.close()
    return 0
