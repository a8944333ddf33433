"""A real `nats-server -js` per test: free port, temp store dir, readiness polled with a deadline.

No skipping: a missing binary fails with a message naming the fix (scripts/ensure-system-deps.sh
installs it via apt-get)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from router_api.procs import spawn, stop as stop_process
from support.net import free_port

NATS_BIN_ENV = "KVATLAS_NATS_SERVER"


def nats_binary() -> str:
    path = os.environ.get(NATS_BIN_ENV) or shutil.which("nats-server") or "/usr/sbin/nats-server"
    if not os.path.exists(path):
        raise RuntimeError(f"nats-server not found (looked at {path!r}); install it with "
                           "`apt-get install -y nats-server` (scripts/ensure-system-deps.sh does) "
                           f"or point {NATS_BIN_ENV} at the binary")
    return path




# Users for the route plane's tests (docs/reference.md, "Security"): the indexer replicas' own user,
# and a worker's, which may publish events but neither read nor write the route subject.
ROUTE_PLANE_USERS_CONF = """
authorization {
  users = [
    {user: indexer, password: ipw}
    {user: worker, password: wpw, permissions: {
        publish: {allow: ["kvatlas.events.>"], deny: ["kvatlas.routes"]},
        subscribe: {allow: ["_INBOX.>"], deny: ["kvatlas.routes"]}}}
  ]
}
"""


class NatsServer:
    """`nats-server -js` on 127.0.0.1; `stop()` / `start()` keep the port and store dir."""

    __slots__ = ("port", "store_dir", "proc", "_own_dir", "log_path", "config")

    def __init__(self, store_dir: str | None = None, config: str | None = None) -> None:
        self.config = config  # a nats-server config file (users, permissions), or None: open to all
        self._own_dir = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="kvatlas-nats-")
        self.log_path = str(Path(self.store_dir) / "server.log")
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 10.0, attempts: int = 5) -> NatsServer:
        binary = nats_binary()
        last = ""
        for _ in range(attempts):
            if not self.port or self.proc is not None:
                self.port = free_port()
            self.proc = spawn(
                [binary, *(["-c", self.config] if self.config else []), "-js", "-a", "127.0.0.1",
                 "-p", str(self.port), "-sd", self.store_dir, "-l", self.log_path],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                if self._ready():
                    return self
                time.sleep(0.01)  # polling an external process's readiness
            last = self._tail()
            self._kill()
            self.port = 0
        raise RuntimeError(f"nats-server did not start after {attempts} attempts: {last}")

    def restart(self, timeout: float = 10.0) -> NatsServer:
        """Stop and start again on the same port with the same store."""
        port = self.port
        self.stop()
        self.port = port
        self.proc = None
        binary = nats_binary()
        self.proc = spawn(
            [binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", self.store_dir, "-l", self.log_path],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self._ready():
                return self
            time.sleep(0.01)
        raise RuntimeError(f"nats-server did not restart: {self._tail()}")

    def _ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.settimeout(0.5)
                return s.recv(4) == b"INFO"
        except OSError:
            return False

    def _tail(self) -> str:
        try:
            return Path(self.log_path).read_text()[-800:]
        except OSError:
            return "(no log)"

    def _kill(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def stop(self) -> None:
        self._kill()

    def close(self) -> None:
        self._kill()
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
