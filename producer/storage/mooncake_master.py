"""Run a `mooncake_master` as a child process (tests, the bench, `kvatlas demo --l3 mooncake`):
free ports, the HTTP metadata server in the same process, readiness polled against a deadline,
and the child killed by the kernel if its parent dies (PR_SET_PDEATHSIG)."""
from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def master_binary() -> str | None:
    """The `mooncake_master` of this Python's environment (the `mooncake` extra), else on PATH."""
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


def die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """A running master: `.address` (RPC host:port), `.metadata` (HTTP metadata URL)."""

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
        """A `mooncake` L3 backend's config on this master (small segments unless overridden)."""
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

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if _listening(self.rpc_port) and _listening(self.http_port):
                return True
            time.sleep(0.02)  # probing a child process's readiness
        return False


def _spawn(args: list[str], log_path: Path, mode: str) -> subprocess.Popen[bytes]:
    with open(log_path, mode) as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)


def start_mooncake_master(log_dir: Path, *flags: str, attempts: int = 3,
                          ports: tuple[int, int] | None = None) -> MooncakeMaster:
    """Start a master on free ports (retried if another process took one first). `flags` are extra
    master flags, e.g. `--default_kv_lease_ttl=1000`; its output goes to `log_dir`."""
    binary = master_binary()
    if binary is None:
        raise RuntimeError("mooncake_master not found: `pip install 'kvatlas[mooncake]'` "
                           "(mooncake-transfer-engine-non-cuda; system libraries libibverbs1 librdmacm1 libnuma1)")
    last = ""
    for _ in range(attempts):
        rpc, http = ports or (_free_port(), _free_port())
        log_path = log_dir / f"mooncake-master-{rpc}.log"
        # its metrics/admin server too (0.0.0.0:9003 by default: a second master would fail to start)
        args = [binary, f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                f"--http_metadata_server_port={http}", "--http_metadata_server_host=127.0.0.1",
                "--rpc_address=127.0.0.1", f"--metrics_port={_free_port()}", "--metrics_host=127.0.0.1", *flags]
        master = MooncakeMaster(rpc, http, _spawn(args, log_path, "wb"), log_path, args)
        if master._wait_ready(20.0):
            return master
        master.stop()
        last = log_path.read_text(errors="replace")[-800:]
    raise RuntimeError(f"mooncake_master did not start after {attempts} attempts: {last}")


def restart_mooncake_master(master: MooncakeMaster) -> MooncakeMaster:
    """A fresh (empty) master on the same ports and flags, after `master` was killed."""
    if master.proc.poll() is None:
        raise RuntimeError("the master is still running: kill it first")
    fresh = MooncakeMaster(master.rpc_port, master.http_port, _spawn(master.args, master.log_path, "ab"),
                           master.log_path, master.args)
    if fresh._wait_ready(20.0):
        return fresh
    fresh.stop()
    raise RuntimeError("mooncake_master did not restart: " + master.log_path.read_text(errors="replace")[-800:])
