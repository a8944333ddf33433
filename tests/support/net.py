"""Test plumbing without pytest: free ports, polling against a deadline, a real redis-server.

Nothing here sleeps to synchronise: readiness is polled against a deadline.
"""
from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from router_api.procs import spawn, stop as stop_process

REDIS_BIN = os.environ.get("KVATLAS_REDIS_SERVER", "/usr/bin/redis-server")
REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768 on Linux unless configured)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports below the ephemeral range: a port the OS hands out for bind(0) is also a candidate source port
# of every outgoing connection (a Redis client, an HTTP probe), which can take it between this call and
# the test's own bind ("Address already in use"). Below the range only explicit binds use a port.
_PORT_LOW = 20000
_PORT_HIGH = max(_PORT_LOW + 1000, min(_ephemeral_low(), 32768))
_given: set[int] = set()
_rng = random.Random(os.getpid() ^ time.monotonic_ns())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the ephemeral range and not handed
    out before by this process (a test may take several before binding any)."""
    for _ in range(2000):
        port = _rng.randrange(_PORT_LOW, _PORT_HIGH)
        if port in _given:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the range is crowded: let the OS pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_until_closed(s: socket.socket) -> bytes:
    """Everything a server sends until it closes (the socket's timeout fails the caller if it never does)."""
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk


def wait_until(predicate: Callable[[], object], timeout: float = 5.0, interval: float = 0.005) -> object:
    """Poll `predicate` until it returns a truthy value; raise AssertionError at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not met within {timeout}s: {predicate!r}")
        # A short pause between probes of an external condition (a poll, not a synchronisation).
        time.sleep(interval)


class RedisServer:
    """A running redis-server owned by one test."""

    __slots__ = ("host", "port", "proc")

    def __init__(self, host: str, port: int, proc: subprocess.Popen[bytes]) -> None:
        self.host = host
        self.port = port
        self.proc = proc

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def ping(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        stop_process(self.proc)


def start_redis_server(tmp_dir: Path, attempts: int = 3) -> RedisServer:
    """Start redis-server on a free port (retrying if another process grabbed the port first)."""
    last_err = ""
    for _ in range(attempts):
        port = free_port()
        proc = spawn(
            [REDIS_BIN, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(tmp_dir), "--protected-mode", "no", "--loglevel", "warning"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        server = RedisServer("127.0.0.1", port, proc)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            if server.ping():
                return server
            time.sleep(0.01)  # probing a child process's readiness
        out = proc.stdout.read().decode(errors="replace") if proc.poll() is not None and proc.stdout else ""
        last_err = out.strip()[-500:]
        server.stop()
    raise RuntimeError(f"redis-server did not start after {attempts} attempts: {last_err}")


class ThreadedServer:
    """A real uvicorn server for an ASGI app, on a free port in a thread of the test process."""

    def __init__(self, app: object) -> None:
        import threading

        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, timeout=20)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

