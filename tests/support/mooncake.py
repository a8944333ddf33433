"""A real `mooncake_master` per test: free ports, its HTTP metadata server in the same process,
killed with the test (and by the kernel if the test process dies first: PR_SET_PDEATHSIG).

The binary comes with `pip install mooncake-transfer-engine-non-cuda` (the `mooncake` extra);
it needs libibverbs1, librdmacm1 and libnuma1 (scripts/ensure-system-deps.sh installs them).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.net import free_port

_PR_SET_PDEATHSIG = 1
os.environ.setdefault("GLOG_minloglevel", "2")  # the Mooncake client logs every setup step at INFO


def master_binary() -> str | None:
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """A running master owned by one test: `.address` (RPC host:port), `.metadata` (HTTP URL)."""

    __slots__ = ("rpc_port", "http_port", "proc", "log_path", "args")

    def __init__(self, rpc_port: int, http_port: int, proc: subprocess.Popen[bytes], log_path: Path,
                 args: list[str]) -> None:
        self.rpc_port = rpc_port
        self.http_port = http_port
        self.proc = proc
        self.log_path = log_path
        self.args = args

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def backend_config(self, **extra: object) -> dict[str, object]:
        """The `--l3-config` of a backend on this master (small segments: tests share 24 GiB)."""
        return {"master_server_address": self.address, "metadata_server": self.metadata,
                "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20, **extra}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()


def start_mooncake_master(tmp_dir: Path, *flags: str, attempts: int = 3) -> MooncakeMaster:
    """Start a master on free ports (retried if another process took a port first); `flags` are
    extra master flags such as `--default_kv_lease_ttl=100`."""
    binary = master_binary()
    if binary is None:
        raise RuntimeError("mooncake_master not found: `pip install -e '.[mooncake]'` (make test installs it)")
    last = ""
    for n in range(attempts):
        rpc, http = free_port(), free_port()
        log_path = tmp_dir / f"mooncake-master-{rpc}.log"
        args = [binary, f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                f"--http_metadata_server_port={http}", "--http_metadata_server_host=127.0.0.1",
                "--rpc_address=127.0.0.1", *flags]
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        master = MooncakeMaster(rpc, http, proc, log_path, args)
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline and proc.poll() is None:
            if _listening(rpc) and _listening(http):
                return master
            time.sleep(0.02)  # probing a child process's readiness
        master.stop()
        last = log_path.read_text(errors="replace")[-800:]
    raise RuntimeError(f"mooncake_master did not start after {attempts} attempts: {last}")


def restart(master: MooncakeMaster, tmp_dir: Path) -> MooncakeMaster:
    """A fresh (empty) master on the same ports, after `master` was killed."""
    assert master.proc.poll() is not None, "kill the master first"
    with open(master.log_path, "ab") as out:
        proc = subprocess.Popen(master.args, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    fresh = MooncakeMaster(master.rpc_port, master.http_port, proc, master.log_path, master.args)
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline and proc.poll() is None:
        if _listening(fresh.rpc_port) and _listening(fresh.http_port):
            return fresh
        time.sleep(0.02)  # probing a child process's readiness
    fresh.stop()
    raise RuntimeError("mooncake_master did not restart: " + master.log_path.read_text(errors="replace")[-800:])


def master_fixture(tmp_path_factory: pytest.TempPathFactory, *flags: str) -> Iterator[MooncakeMaster]:
    if master_binary() is None:
        pytest.fail("mooncake_master not found (make test installs the `mooncake` extra and its system libraries)")
    master = start_mooncake_master(tmp_path_factory.mktemp("mooncake"), *flags)
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """A fresh master for this test, leases short (100 ms) so removals after a read go through."""
    yield from master_fixture(tmp_path_factory, "--default_kv_lease_ttl=100")
