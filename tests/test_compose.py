"""compose.yaml without Docker: the file is validated, then every service's command runs as a local
process with the service's environment — service host names mapped to 127.0.0.1, container ports
to free ports, a redis-server this test starts standing in for the `redis` service and a real
`nats-server -js` running the `nats` service's own arguments — in `depends_on` order, each waited
for by its own healthcheck; then the router's report is checked, and the second indexer replica
(fed only through the shared registry) is checked to hold exactly what the first one holds."""
from __future__ import annotations

import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import yaml

from router_api.demo.procs import Child, http_json
from router_api.router.report import summarize
from router_api.router.trace import TokenExpander, load_trace, slice_conversations
from sim.api import RouterReport
from support.net import REPO_ROOT, free_port, wait_until
from support.nats import nats_binary

SERVICES = {"redis", "nats", "indexer", "indexer2", "worker1", "worker2", "worker3", "router"}
EXTERNAL = {"redis", "nats"}  # not our image: stand-ins run locally
INDEXERS = ("indexer", "indexer2")
WORKERS = ("worker1", "worker2", "worker3")
PORT_FLAGS = {"nats": ("-p", "-m")}
KVATLAS_PORT_FLAGS = ("--port", "--zmq-port", "--replay-port")


def load_compose() -> dict:
    return yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())


def container_ports(svc: dict) -> list[int]:
    ports = [int(str(p).split(":")[-1]) for p in svc.get("ports", [])]
    return sorted(set(ports + [int(p) for p in svc.get("expose", [])]))


def start_order(services: dict) -> list[str]:
    order: list[str] = []
    while len(order) < len(services):
        ready = [n for n, s in services.items() if n not in order and all(d in order for d in s.get("depends_on", {}))]
        assert ready, f"depends_on has a cycle among {set(services) - set(order)}"
        order.extend(sorted(ready))
    return order


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_compose_file_is_complete_and_consistent() -> None:
    c = load_compose()
    services = c["services"]
    assert set(services) == SERVICES
    assert (REPO_ROOT / "Dockerfile").exists() and (REPO_ROOT / ".dockerignore").exists()
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert "tests/data/traces" in dockerfile and "pip install" in dockerfile
    for name, svc in services.items():
        assert svc.get("healthcheck", {}).get("test"), f"{name}: no healthcheck"
        assert container_ports(svc), f"{name}: no ports"
        cmd = svc["command"]
        assert isinstance(cmd, list) and all(isinstance(a, str) for a in cmd)
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in services and cond == {"condition": "service_healthy"}, (name, dep)
        if name in EXTERNAL:
            assert svc["image"].startswith(f"{name}:") and "build" not in svc, name
            continue
        assert svc["build"] == "." and svc["image"] == "kvatlas:latest"
        role = "indexer" if name in INDEXERS else {"router": "router"}.get(name, "worker")
        assert cmd[0] == "kvatlas" and cmd[1] == role, name
        assert svc.get("environment", {}).get("PYTHONUNBUFFERED") == "1"
    # nats: JetStream on, client and monitoring ports, healthy only once JetStream is up
    nats = services["nats"]
    assert "-js" in nats["command"] and flag(nats["command"], "-p") == "4222"
    assert {4222, int(flag(nats["command"], "-m") or 0)} <= set(container_ports(nats))
    assert nats["healthcheck"]["test"][:3] == ["CMD", "wget", "-qO-"]
    assert "/healthz?js-enabled-only=true" in nats["healthcheck"]["test"][3]
    # two replicas: same model, both on Redis snapshots (own keys) and on the same NATS
    keys, host_ports = set(), set()
    for name in INDEXERS:
        svc, cmd = services[name], services[name]["command"]
        assert flag(cmd, "--nats") == "nats://nats:4222", name
        assert (flag(cmd, "--snapshot") or "").startswith("redis://redis:6379"), name  # snapshots in Redis
        assert flag(cmd, "--model") == "demo" and flag(cmd, "--block-size") == "512", name
        assert set(svc["depends_on"]) == {"redis", "nats"}, name
        keys.add(flag(cmd, "--snapshot-key") or "kvatlas:snapshot")
        host_ports.update(str(p).split(":")[0] for p in svc["ports"])
    assert len(keys) == 2 and len(host_ports) == 2, (keys, host_ports)
    for w in WORKERS:
        cmd = services[w]["command"]
        assert flag(cmd, "--l3") == "redis" and flag(cmd, "--id") == w
        assert flag(cmd, "--advertise-host") == w and flag(cmd, "--indexer") == "http://indexer:8700"
        assert set(services[w]["depends_on"]) == {"redis", "indexer"}
    router = services["router"]["command"]
    assert set(services["router"]["depends_on"]) == {"indexer", *WORKERS}
    assert "--trace" in router and "--report" in router
    order = start_order(services)
    assert set(order[:2]) == EXTERNAL and order[-1] == "router"


def localize(services: dict, redis_port: int, out_dir: Path) -> tuple[dict[tuple[str, int], int], dict[str, list[str]]]:
    ports = {(n, p): (redis_port if n == "redis" else free_port())
             for n, s in services.items() for p in container_ports(s)}

    def sub(arg: str) -> str:
        def url(m: re.Match[str]) -> str:
            return f"{m.group(1)}127.0.0.1:{ports[(m.group(2), int(m.group(3)))]}"
        arg = re.sub(r"(//)([a-z0-9]+):(\d+)", url, arg)
        arg = arg.replace("/app/", f"{REPO_ROOT}/").replace("/out/", f"{out_dir}/")
        return arg

    cmds: dict[str, list[str]] = {}
    for name, svc in services.items():
        if name == "redis":
            continue
        cmd = [sub(a) for a in svc["command"]]
        for i, a in enumerate(cmd[:-1]):
            if a in PORT_FLAGS.get(name, KVATLAS_PORT_FLAGS):
                cmd[i + 1] = str(ports[(name, int(cmd[i + 1]))])
            elif a == "--advertise-host" or (a == "--host" and cmd[i + 1] == "0.0.0.0"):
                cmd[i + 1] = "127.0.0.1"
            elif name == "nats" and a == "-sd":
                cmd[i + 1] = str(out_dir / "nats-data")
        if name == "nats":  # the image's entrypoint prepends nats-server to a command of flags
            cmds[name] = [nats_binary(), *cmd, "-a", "127.0.0.1"]
        else:
            cmds[name] = [sys.executable, "-m", "cli.main", *cmd[1:]]
    return ports, cmds


def healthy(svc: dict, ports: dict[tuple[str, int], int], name: str) -> bool:
    test = svc["healthcheck"]["test"]
    assert test[0] == "CMD"

    def local(text: str) -> str:
        return re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{ports[(name, int(m.group(1)))]}", text)

    if test[1] == "wget":  # `wget -qO- URL`: healthy when the URL answers 2xx
        try:
            with urllib.request.urlopen(local(test[-1]), timeout=2) as r:
                return 200 <= r.status < 300
        except (urllib.error.URLError, OSError):
            return False
    assert test[1] == "python" and test[2] == "-c", test
    return subprocess.run([sys.executable, "-c", local(test[-1])], capture_output=True, timeout=10).returncode == 0


def score_rows(base: str, tokens: list[int]) -> dict[str, tuple[Any, ...]]:
    resp = http_json(f"{base}/score", "POST", {"token_ids": tokens, "model": "demo"}, timeout=10)
    return {r["worker_id"]: (r["device_blocks"], r["cached_blocks"], tuple(sorted(r["tiers"].items())),
                             r["last_seq"]) for r in resp["workers"]}


def replicas_agree(bases: list[str], prompts: list[list[int]], seen: dict[str, Any]) -> bool:
    """Both replicas at the same `last_seq` per worker (events still in flight: not yet), and then
    every prompt scored identically. `seen` keeps the last observation for the failure message."""
    seqs = [{w["worker_id"]: w["last_seq"] for w in http_json(f"{b}/workers")["workers"]} for b in bases]
    seen["last_seq"] = seqs
    if seqs[0] != seqs[1] or set(seqs[0]) != set(WORKERS) or None in seqs[0].values():
        return False
    scores = [[score_rows(b, p) for p in prompts] for b in bases]
    seen["scores"] = scores
    return scores[0] == scores[1] and all({w: r[3] for w, r in s.items()} == seqs[0] for s in scores[0])


def read_report(path: Path) -> RouterReport | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=RouterReport)
    except (OSError, msgspec.DecodeError):
        return None


def tails(children: list[Child], names: tuple[str, ...]) -> str:
    return "\n".join(f"--- {c.name}\n{c.tail(30)}" for c in children if c.name in names)


def metric(text: str, name: str, labels: str) -> float | None:
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return None if m is None else float(m.group(1))


def test_compose_services_run_as_local_processes(redis_server, tmp_path: Path) -> None:
    services = load_compose()["services"]
    ports, cmds = localize(services, redis_server.port, tmp_path)
    children: list[Child] = []
    try:
        for name in start_order(services):
            if name == "redis":
                assert redis_server.ping()
                continue
            for dep in services[name].get("depends_on", {}):
                if dep != "redis":
                    wait_until(lambda: healthy(services[dep], ports, dep), timeout=90, interval=0.2)
            env = {k: str(v) for k, v in services[name].get("environment", {}).items()}
            children.append(Child(name, cmds[name], tmp_path, env=env))
        router = children[-1]
        wait_until(lambda: healthy(services["router"], ports, "router"), timeout=90, interval=0.2)
        report_path = tmp_path / "router-report.json"
        # the router writes the file in place: a reader can catch it half written, so poll until it decodes
        wait_until(lambda: read_report(report_path) or not router.alive(), timeout=120, interval=0.2)
        rep = read_report(report_path)
        assert rep is not None, router.tail()
        row = summarize(rep.policy, 1, rep.records)
        assert rep.policy == "precise_tiered" and row.requests == 200 and row.errors == 0
        assert row.hit_ratio > 0.2 and row.prediction_accuracy is not None, row
        # misses are timing (more on a loaded box: the floor is what a broken index would fall through),
        # each attributed to its cause
        misses = round((1.0 - row.prediction_accuracy) * row.requests)
        assert row.prediction_accuracy >= 0.5 and sum(row.causes.values()) == misses, row
        for name in services:  # nothing depends on indexer2: its own healthcheck, like compose's
            if name != "redis":
                assert healthy(services[name], ports, name), name
        bases = [f"http://127.0.0.1:{ports[(n, 8700)]}" for n in INDEXERS]
        for base in bases:
            listed = http_json(f"{base}/workers")["workers"]
            assert {w["worker_id"] for w in listed} == set(WORKERS), (base, listed)
            assert all(w["status"] == "live" for w in listed), (
                base, [(w["worker_id"], w["status"], w["last_seq"], w["gaps"], w["replays"], w["resyncs"])
                       for w in listed], tails(children, INDEXERS))
            # the shared L3 in Redis: backups are announced as EXTERNAL and scored as the shared pool
            assert sum(w["blocks"]["shared"] for w in listed) > 0, (base, listed)
        assert http_json(f"http://127.0.0.1:{ports[('router', 8800)]}/health")["done"] == 200

        # indexer2 was told of the workers only by the shared registry and reads their publishers
        # itself: once both replicas applied the same seqs, every score must be identical
        replay = slice_conversations(load_trace(REPO_ROOT / "tests/data/traces/mooncake_synthetic_trace.jsonl"),
                                     200, seed=0)
        expand = TokenExpander()
        prompts = [expand.tokens(replay[i]).tolist() for i in (10, 60, 110, 160, 199)]
        seen: dict[str, Any] = {}
        try:
            wait_until(lambda: replicas_agree(bases, prompts, seen), timeout=30, interval=0.2)
        except AssertionError:
            raise AssertionError(f"indexer and indexer2 disagree: {seen}\n{tails(children, INDEXERS)}") from None
        assert any(r[1] > 0 for s in seen["scores"][0] for r in s.values()), seen  # not trivially equal

        # the JetStream plane's metrics on the replica: registrations carried over, stream size
        text = urllib.request.urlopen(f"{bases[1]}/metrics", timeout=5).read().decode()
        assert (metric(text, "kvatlas_shared_registry_applied_total", 'op="put"') or 0) >= len(WORKERS), text
        assert metric(text, "kvatlas_jetstream_stream", 'field="bytes"') is not None, text
        assert metric(text, "kvatlas_nats_connection_total", 'event="errors"') == 0, text
    finally:
        for c in reversed(children):
            c.stop()
