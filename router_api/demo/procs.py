"""Child processes of the demo: start `kvatlas` subcommands, wait for their HTTP health, stop
them (SIGTERM to their process group, then SIGKILL after a grace period). They die with the demo
however it ends (router_api/procs.py: process groups, PR_SET_PDEATHSIG; `kvatlas demo` runs under
`exit_on_signals`)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from router_api import procs


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def kvatlas_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", "--log-level", "WARNING", *args]


class Child:
    """One child process with its log file."""

    __slots__ = ("name", "proc", "log_path", "_log")

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log: IO[bytes] = open(self.log_path, "wb")
        self.proc = procs.spawn(argv, session=True, stdout=self._log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 5.0) -> None:
        procs.stop(self.proc, grace)
        self._log.close()


def http_json(url: str, method: str = "GET", body: Any = None, timeout: float = 5.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def wait_healthy(children: Sequence[tuple[Child, str]], timeout: float = 90.0) -> None:
    """Until every child answers GET <url>/health; a child that exits first fails with its log."""
    pending = list(children)
    deadline = time.monotonic() + timeout
    while pending:
        for item in list(pending):
            child, url = item
            if not child.alive():
                raise RuntimeError(f"{child.name} exited ({child.proc.returncode}):\n{child.tail()}")
            try:
                http_json(f"{url}/health", timeout=2.0)
                pending.remove(item)
            except (urllib.error.URLError, OSError, ValueError):
                pass
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout}s: {[c.name for c, _ in pending]}")
            time.sleep(0.1)  # readiness poll
