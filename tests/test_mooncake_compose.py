"""compose.mooncake.yaml (the fleet's shared L3 on Mooncake Store) without Docker: it overrides
only services compose.yaml has, plus the master; the master's own command runs here (ports mapped
to free ones) and a worker's own `--l3-config` (host names mapped to 127.0.0.1) stores and reads
through it."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from producer.storage import make_storage_backend
from producer.storage.mooncake_master import MooncakeMaster, die_with_parent, master_binary
from support.net import REPO_ROOT, free_port, wait_until

WORKERS = ("worker1", "worker2", "worker3")


def load(name: str) -> dict:
    return yaml.safe_load((REPO_ROOT / name).read_text())["services"]


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_override_is_consistent_with_the_base_fleet() -> None:
    base, over = load("compose.yaml"), load("compose.mooncake.yaml")
    assert set(over) == {"mooncake", *WORKERS} and set(WORKERS) <= set(base)
    m = over["mooncake"]
    assert m["command"][0] == "mooncake_master" and m["healthcheck"]["test"][0] == "CMD"
    for w in WORKERS:
        cmd = over[w]["command"]
        assert cmd[:2] == ["kvatlas", "worker"] and flag(cmd, "--id") == w and flag(cmd, "--l3") == "mooncake"
        # the override changes the L3 and nothing else of the worker's command
        strip = lambda c: [a for a in c if a not in ("--l3", "--l3-config", flag(c, "--l3"), flag(c, "--l3-config"))]  # noqa: E731
        assert strip(cmd) == strip(base[w]["command"])
        cfg = json.loads(flag(cmd, "--l3-config"))
        assert cfg["local_hostname"] == w and cfg["master_server_address"] == "mooncake:50051"
        assert "mooncake" in over[w]["depends_on"]
        make_storage_backend("mooncake", cfg)  # every option is one the backend takes


def test_the_master_command_runs_and_a_worker_config_stores_through_it(tmp_path: Path) -> None:
    m = load("compose.mooncake.yaml")["mooncake"]
    rpc, http = free_port(), free_port()
    args = [master_binary() or "mooncake_master"] + [
        re.sub(r"^(--rpc_port=)\d+", rf"\g<1>{rpc}", re.sub(r"^(--http_metadata_server_port=)\d+", rf"\g<1>{http}", a))
        for a in m["command"][1:]] + [f"--metrics_port={free_port()}", "--metrics_host=127.0.0.1"]  # not 9003
    with open(tmp_path / "master.log", "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    master = MooncakeMaster(rpc, http, proc, tmp_path / "master.log", args)
    be = None
    try:
        assert master._wait_ready(20.0), (tmp_path / "master.log").read_text()[-500:]
        cfg = json.loads(flag(load("compose.mooncake.yaml")["worker1"]["command"], "--l3-config"))
        cfg.update(master_server_address=master.address, metadata_server=master.metadata, local_hostname="127.0.0.1",
                   global_segment_size="64mb", local_buffer_size="16mb")
        be = make_storage_backend("mooncake", cfg)
        assert be.set(["compose"], [b"page"]) == [True]
        wait_until(lambda: be.get(["compose"]) == [b"page"], timeout=5.0)
    finally:
        if be is not None:
            be.close()
        master.stop()
