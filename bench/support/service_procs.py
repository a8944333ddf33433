"""The two services bench/bench_service.py measures, as processes it starts and talks to: kvatlas'
indexer (and its embedded mode) and Dynamo's standalone indexer, the HTTP clients it times them with,
and the process probes (RSS, CPU seconds) it reads.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parents[2]

from bench.support.service_stream import BS  # noqa: E402

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_s(pid: int) -> float:
    """CPU seconds the process has used on every thread: the sum of its threads' scheduler run
    times (ns resolution; /proc/<pid>/stat's clock ticks are 10 ms, too coarse for a 0.2 s run).
    Threads that already exited are not counted: both services keep theirs for their lifetime."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            continue  # the thread ended between listdir and open
    return total / 1e9


def wait_for(pred: Callable[[], bool], timeout: float, what: str, interval: float = 0.01) -> float:
    t0 = time.perf_counter()
    while not pred():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(interval)  # polling an external process, not synchronising threads
    return time.perf_counter()


# --- the two services ---------------------------------------------------------------------------

class Http:
    """http.client on one keep-alive connection: ~0.07 ms of Python per request on this box (its
    request building and `email`-based header parsing), the same for both services."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(self, path: str, body: bytes, ctype: str, accept: str = "application/json") -> tuple[int, bytes]:
        self.conn.request("POST", path, body=body, headers={"Content-Type": ctype, "Accept": accept})
        r = self.conn.getresponse()
        return r.status, r.read()

    def get(self, path: str) -> tuple[int, bytes]:
        self.conn.request("GET", path)
        r = self.conn.getresponse()
        return r.status, r.read()


class LeanHttp:
    """A minimal HTTP/1.1 keep-alive client for the timed queries: the request head is built with
    one bytes join, the answer read by its Content-Length (both services send one; chunked or
    close-delimited answers raise). It costs ~0.01 ms a request against http.client's ~0.07, so
    the latency rows measure the services rather than the client (`--client http.client` restores
    the old client; the same one serves both services either way)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.host = f"Host: 127.0.0.1:{port}\r\n".encode()
        self.buf = bytearray(4 << 20)
        self.view = memoryview(self.buf)

    def post(self, path: str, body: bytes, ctype: str, accept: str = "application/json") -> tuple[int, bytes]:
        head = b"".join((b"POST ", path.encode(), b" HTTP/1.1\r\n", self.host, b"Content-Type: ", ctype.encode(),
                         b"\r\nAccept: ", accept.encode(), b"\r\nContent-Length: ", str(len(body)).encode(),
                         b"\r\n\r\n"))
        sent = self.sock.sendmsg([head, body])  # head and body in one syscall, the body not copied
        if sent < len(head) + len(body):
            self.sock.sendall((head + body)[sent:])
        return self._answer()

    def get(self, path: str) -> tuple[int, bytes]:
        self.sock.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\n" + self.host + b"\r\n")
        return self._answer()

    def _answer(self) -> tuple[int, bytes]:
        # One buffer for every answer (`recv_into`): `recv(n)` allocates n bytes per call, and a
        # large n is an mmap + munmap per request in the client, timed as if it were the service's.
        buf, view, have = self.buf, self.view, 0
        while True:
            got = self.sock.recv_into(view[have:])
            if not got:
                raise ConnectionError("connection closed inside an answer")
            have += got
            end = buf.find(b"\r\n\r\n", 0, have)
            if end >= 0:
                break
        end += 4
        lines = bytes(buf[:end]).split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length = None
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length is None:
            raise ValueError(f"answer without Content-Length: {lines[0]!r}")
        if end + length > len(buf):
            raise ValueError(f"answer of {length} bytes exceeds the client's buffer")
        while have < end + length:
            got = self.sock.recv_into(view[have:])
            if not got:
                raise ConnectionError("connection closed inside an answer's body")
            have += got
        if have != end + length:
            raise ValueError("bytes past the answer (nothing was pipelined)")
        return status, bytes(buf[end:have])


CLIENTS: dict[str, Callable[[int], Any]] = {"lean": LeanHttp, "http.client": Http}
CLIENT: list[Callable[[int], Any]] = [LeanHttp]  # set from --client in main()


class Service:
    name = ""
    proc: subprocess.Popen

    def wait_up(self) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: rc={self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return True
            except OSError:
                return False
        wait_for(up, 60, f"{self.name} to listen")
        self.http = CLIENT[0](self.port)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class Kvatlas(Service):
    name = "kvatlas"

    def __init__(self, *extra: str, name: str = "kvatlas", root: Path = ROOT) -> None:
        """`root`: the source tree the service runs from (another checkout, built in place: an A/B)."""
        self.name = name
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "--log-level", "WARNING", "indexer", "--port", str(self.port),
             "--block-size", str(BS), "--stale-after", "600", "--remove-after", "3600", *extra], cwd=str(root))
        self.wait_up()

    def register(self, i: int, ep: str, rep: str) -> None:
        st, body = self.http.post("/workers", json.dumps({"worker_id": f"w{i}", "endpoint": ep, "replay_endpoint": rep,
                                                          "block_size": BS}).encode(), "application/json")
        assert st == 201, body

    def matched(self, tokens: list[int]) -> dict[str, int]:
        st, body = self.http.post("/score", msgspec.json.encode({"token_ids": tokens}), "application/json")
        assert st == 200, body
        return {w["worker_id"]: w["cached_blocks"] for w in msgspec.json.decode(body)["workers"]}

    def queries(self) -> dict[str, tuple[Callable[[list[int]], bytes], Callable[[bytes], bytes]]]:
        return {
            "health": (lambda t: b"", lambda b: self._get("/health")),
            "json": (lambda t: msgspec.json.encode({"token_ids": t}),
                     lambda b: self._q("/score", b, "application/json")),
            "msgpack": (lambda t: msgspec.msgpack.encode({"token_ids": t}),
                        lambda b: self._q("/score", b, "application/msgpack", "application/msgpack")),
            "binary": (lambda t: np.asarray(t, dtype="<u4").tobytes(),
                       lambda b: self._q("/score", b, "application/octet-stream", "application/msgpack")),
        }

    def decode(self, fmt: str, body: bytes) -> dict[str, int]:
        ans = (msgspec.json.decode if fmt == "json" else msgspec.msgpack.decode)(body)
        return {w["worker_id"]: w["cached_blocks"] for w in ans["workers"]}

    def _q(self, path: str, body: bytes, ctype: str, accept: str = "application/json") -> bytes:
        st, out = self.http.post(path, body, ctype, accept)
        assert st == 200, out
        return out

    def _get(self, path: str) -> bytes:
        st, out = self.http.get(path)
        assert st == 200, out
        return out


class Embedded:
    """kvatlas embedded in this process (router_api.embedded): subscribed to the same publishers,
    scored with no HTTP. Measured after the HTTP services, so its ingest thread idles meanwhile."""

    name = "embedded"

    def __init__(self) -> None:
        from router_api.embedded import EmbeddedIndexer

        self.idx = EmbeddedIndexer(block_size=BS, stale_after_s=600, remove_after_s=3600).start()

    def register(self, i: int, ep: str, rep: str) -> None:
        self.idx.add_worker({"worker_id": f"w{i}", "endpoint": ep, "replay_endpoint": rep})

    def matched(self, tokens: list[int]) -> dict[str, int]:
        return {w.worker_id: w.cached_blocks for w in self.idx.score(tokens).workers}

    def stop(self) -> None:
        self.idx.close()


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PROBLEM = re.compile(r"^\S+\s+(WARN|ERROR)\b")  # tracing's "<time>  WARN target: message"


class Dynamo(Service):
    name = "dynamo"

    def __init__(self, python: str, threads: int = 1) -> None:
        self.port = free_port()
        self.log = tempfile.TemporaryFile()  # its stderr, shown if it fails to start
        self.proc = subprocess.Popen(
            [python, "-m", "dynamo.indexer", "--port", str(self.port), "--block-size", str(BS), "--threads", str(threads)],
            stdout=subprocess.DEVNULL, stderr=self.log)
        try:
            self.wait_up()
        except RuntimeError as exc:
            self.log.seek(0)
            tail = self.log.read().decode("utf-8", "replace").strip().splitlines()[-3:]
            raise RuntimeError(f"{exc}: {' | '.join(tail)}") from None

    def log_problems(self) -> list[str]:
        """Its WARN / ERROR log lines so far (ANSI colours stripped): an event it dropped or could not
        parse is logged there, and the bench reports them next to the answer check (a service that
        held less than the stream would answer cheaper lookups: not the same content)."""
        self.log.flush()
        self.log.seek(0)
        text = _ANSI.sub("", self.log.read().decode("utf-8", "replace"))
        self.log.seek(0, os.SEEK_END)
        return [ln for ln in text.splitlines() if _PROBLEM.search(ln)]

    def register(self, i: int, ep: str, rep: str) -> None:
        st, body = self.http.post("/register", json.dumps({"instance_id": i, "endpoint": ep, "block_size": BS,
                                                           "model_name": "default"}).encode(), "application/json")
        assert 200 <= st < 300, body

    def matched(self, tokens: list[int]) -> dict[str, int]:
        st, body = self.http.post("/query", msgspec.json.encode({"token_ids": tokens, "model_name": "default"}),
                                  "application/json")
        assert st == 200, body
        return self.decode("json", body)

    def decode(self, fmt: str, body: bytes) -> dict[str, int]:
        # Its scores count matched tokens (1.6.1): blocks are tokens / block size.
        scores = msgspec.json.decode(body).get("scores", {})
        return {f"w{k}": max(v.values()) // BS for k, v in scores.items()}

    def queries(self) -> dict[str, tuple[Callable[[list[int]], bytes], Callable[[bytes], bytes]]]:
        def q(body: bytes) -> bytes:
            st, out = self.http.post("/query", body, "application/json")
            assert st == 200, out
            return out

        def health(_b: bytes) -> bytes:
            st, out = self.http.get("/health")
            assert st == 200, out
            return out
        return {"health": (lambda t: b"", health),
                "json": (lambda t: msgspec.json.encode({"token_ids": t, "model_name": "default"}), q)}
