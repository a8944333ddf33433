"""compose.yaml without Docker: the file is validated, then every service's command runs as a local
process with the service's environment — service host names mapped to 127.0.0.1, container ports
to free ports, a redis-server this test starts standing in for the `redis` service — in
`depends_on` order, each waited for by its own healthcheck; then the router's report is checked."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import yaml

from router_api.demo.procs import Child, http_json
from router_api.router.report import summarize
from schemas.worker import RouterReport
from tests.conftest import REPO_ROOT, free_port, wait_until

SERVICES = {"redis", "indexer", "worker1", "worker2", "worker3", "router"}
PORT_FLAGS = ("--port", "--zmq-port", "--replay-port")


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
        if name == "redis":
            assert svc["image"].startswith("redis")
            continue
        assert svc["build"] == "." and svc["image"] == "kvatlas:latest"
        assert cmd[0] == "kvatlas" and cmd[1] == {"indexer": "indexer", "router": "router"}.get(name, "worker")
        assert svc.get("environment", {}).get("PYTHONUNBUFFERED") == "1"
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in services and cond == {"condition": "service_healthy"}, (name, dep)
    assert "redis://redis:6379" in " ".join(services["indexer"]["command"])  # snapshots in Redis
    for w in ("worker1", "worker2", "worker3"):
        cmd = services[w]["command"]
        assert cmd[cmd.index("--l3") + 1] == "redis" and cmd[cmd.index("--id") + 1] == w
        assert cmd[cmd.index("--advertise-host") + 1] == w
        assert set(services[w]["depends_on"]) == {"redis", "indexer"}
    router = services["router"]["command"]
    assert set(services["router"]["depends_on"]) == {"indexer", "worker1", "worker2", "worker3"}
    assert "--trace" in router and "--report" in router
    assert start_order(services)[0] == "redis" and start_order(services)[-1] == "router"


def localize(services: dict, redis_port: int, out_dir: Path) -> tuple[dict[tuple[str, int], int], dict[str, list[str]]]:
    ports = {(n, p): (redis_port if n == "redis" else free_port())
             for n, s in services.items() for p in container_ports(s)}

    def sub(service: str, arg: str) -> str:
        def url(m: re.Match[str]) -> str:
            return f"{m.group(1)}127.0.0.1:{ports[(m.group(2), int(m.group(3)))]}"
        arg = re.sub(r"(//)([a-z0-9]+):(\d+)", url, arg)
        arg = arg.replace("/app/", f"{REPO_ROOT}/").replace("/out/", f"{out_dir}/")
        return arg

    cmds: dict[str, list[str]] = {}
    for name, svc in services.items():
        if name == "redis":
            continue
        cmd = [sub(name, a) for a in svc["command"]]
        for i, a in enumerate(cmd[:-1]):
            if a in PORT_FLAGS:
                cmd[i + 1] = str(ports[(name, int(cmd[i + 1]))])
            elif a == "--advertise-host" or (a == "--host" and cmd[i + 1] == "0.0.0.0"):
                cmd[i + 1] = "127.0.0.1"
        cmds[name] = [sys.executable, "-m", "router_api.cli", *cmd[1:]]
    return ports, cmds


def healthy(svc: dict, ports: dict[tuple[str, int], int], name: str) -> bool:
    test = svc["healthcheck"]["test"]
    assert test[0] == "CMD"
    script = re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{ports[(name, int(m.group(1)))]}", test[-1])
    return subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=10).returncode == 0


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
        wait_until(lambda: report_path.exists() or not router.alive(), timeout=120, interval=0.2)
        assert report_path.exists(), router.tail()
        rep = msgspec.json.decode(report_path.read_bytes(), type=RouterReport)
        row = summarize(rep.policy, 1, rep.records)
        assert rep.policy == "precise_tiered" and row.requests == 200 and row.errors == 0
        assert row.hit_ratio > 0.2 and row.prediction_accuracy is not None and row.prediction_accuracy >= 0.9, row
        indexer = f"http://127.0.0.1:{ports[('indexer', 8700)]}"
        listed = http_json(f"{indexer}/workers")["workers"]
        assert {w["worker_id"] for w in listed} == {"worker1", "worker2", "worker3"}
        assert all(w["status"] == "live" for w in listed)
        # the shared L3 in Redis: backups are announced as EXTERNAL and scored as the shared pool
        assert sum(w["blocks"]["shared"] for w in listed) > 0, listed
        assert http_json(f"http://127.0.0.1:{ports[('router', 8800)]}/health")["done"] == 200
    finally:
        for c in reversed(children):
            c.stop()
