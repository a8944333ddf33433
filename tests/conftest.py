"""Shared test fixtures: free ports, a real redis-server, the captured wire samples, ZMQ contexts.

Everything here starts real processes/sockets and cleans them up; nothing sleeps to synchronise
(readiness is polled against a deadline). Plain helpers live in tests/support/ (net.py, service.py).
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.nats import NatsServer
from support.net import REDIS_BIN, REPO_ROOT, RedisServer, free_port, start_redis_server, wait_until


@pytest.fixture(name="free_port")
def free_port_fixture() -> Callable[[], int]:
    """Callable returning a fresh free port each call: `port = free_port()`."""
    return free_port


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., object]:
    return wait_until


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


@pytest.fixture(name="nats")
def nats_fixture() -> Iterator[NatsServer]:
    """A real nats-server with JetStream on free ports, for one test."""
    with NatsServer() as srv:
        yield srv
