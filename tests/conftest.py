"""Shared test fixtures: free ports, a real redis-server, the captured wire samples, ZMQ contexts.

Everything here starts real processes/sockets and cleans them up; nothing sleeps to synchronise
(readiness is polled against a deadline).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REDIS_BIN = os.environ.get("KVATLAS_REDIS_SERVER", "/usr/bin/redis-server")
REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


@contextmanager
def service_with_publisher(block_size: int) -> Iterator[tuple[object, object]]:
    """A started `IndexerService` (no HTTP) and a real ZmqEventPublisher registered to it as "w0",
    once the subscription delivers; both closed afterwards. Yields (service, publisher)."""
    from producer.publisher import ZmqEventPublisher
    from router_api.service import IndexerService, ServiceConfig
    from schemas.api import RegisterWorker

    svc = IndexerService(ServiceConfig(port=0, block_size=block_size, stale_after_s=600, remove_after_s=3600))
    svc.start()
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    try:
        svc.register(RegisterWorker(worker_id="w0", endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint,
                                    block_size=block_size))
        wait_until(lambda: (pub.heartbeat(), svc.registry.get("w0").last_seq is not None)[1], timeout=10)
        yield svc, pub
    finally:
        pub.close()
        svc.stop(final_snapshot=False)


@pytest.fixture(name="free_port")
def free_port_fixture() -> Callable[[], int]:
    """Callable returning a fresh free port each call: `port = free_port()`."""
    return free_port


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., object]:
    return wait_until


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
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def start_redis_server(tmp_dir: Path, attempts: int = 3) -> RedisServer:
    """Start redis-server on a free port (retrying if another process grabbed the port first)."""
    last_err = ""
    for _ in range(attempts):
        port = free_port()
        proc = subprocess.Popen(
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


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A fresh, empty redis-server for this test (`.url`, `.host`, `.port`); killed afterwards.

    Fails (with the reason) when the binary is missing: a skipped test is a test that did not run.
    """
    if not (os.path.exists(REDIS_BIN) or shutil.which("redis-server")):
        pytest.fail(f"redis-server not found at {REDIS_BIN} (make test installs it: scripts/ensure-system-deps.sh)")
    server = start_redis_server(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


WIRE_SAMPLES = REPO_ROOT / "tests" / "data" / "wire-samples"


@pytest.fixture(scope="session")
def wire_samples_dir() -> Path:
    """Directory with the captured engine bytes (`*.msgpack`) and `*.expected.json` final states
    (tests/data/wire-samples; provenance in its README)."""
    if not (WIRE_SAMPLES / "sglang.msgpack").is_file():
        pytest.fail(f"wire samples missing from the repository: {WIRE_SAMPLES}")
    return WIRE_SAMPLES


@pytest.fixture
def zmq_ctx() -> Iterator[object]:
    """A private zmq.Context, terminated (linger 0) after the test so no socket outlives it."""
    import zmq

    ctx = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)
