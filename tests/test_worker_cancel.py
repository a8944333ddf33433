"""A client that disconnects before its simulated request completes cancels it: the request gives its
batch slot back on the worker's timeline (issue: fire-and-forget requests used to hold every slot for
hours of simulated time). The timeline rule is a pure unit test; the disconnects (`/generate`, and the
OpenAI routes streamed and not) go through a real `kvatlas worker` process over a real socket."""
from __future__ import annotations

import json
import re
import socket
import sys
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from sim.api import SimModel
from sim.schedule import Schedule
from router_api.demo.procs import Child, http_json, wait_healthy
from support.net import free_port, wait_until
from support.tiny_tokenizer import TINY_CHAT


def test_cancel_frees_the_slot_from_the_cut_and_moves_no_one_else() -> None:
    s = Schedule(SimModel(max_batch=1, max_queue=8, prefill_tokens_per_s=1.0, prefill_overhead_s=0.0,
                          decode_s_per_token=1.0))
    a = s.admit(0.0, 0.0, 2.0, 10)       # prefill [0, 2), decode to 12
    b = s.admit(1.0, 0.0, 1.0, 1)        # waits for the one batch slot: starts at 12
    assert (b.start, b.finish) == (12.0, 14.0)
    assert s.cancel(a, 5.0) and a.finish == 5.0 and s.running_at(6.0) == 0
    assert (b.start, b.finish) == (12.0, 14.0)  # committed requests keep their places
    c = s.admit(6.0, 0.0, 1.0, 1)        # a later admission takes the freed slot at once
    assert c.start == 6.0
    assert not s.cancel(a, 20.0)         # already over
    assert s.cancel(b, 3.0)              # still waiting: its wait ends at the cut, it never runs
    assert s.queued_at(4.0) == 0 and s.running_at(12.5) == 0 and (12.0, 13.0) not in s.busy


def test_a_disconnected_client_gives_its_batch_slot_back(tmp_path: Path) -> None:
    wp = free_port()
    sim = json.dumps({"decode_s_per_token": 1.0})
    w = Child("worker", [sys.executable, "-m", "cli.main", "--log-level", "WARNING", "worker", "--id", "w0",
                         "--port", str(wp), "--block-size", "16", "--gpu-pages", "64", "--speed", "1",
                         "--sim", sim], tmp_path)
    try:
        wait_healthy([(w, f"http://127.0.0.1:{wp}")])
        body = json.dumps({"token_ids": list(range(1, 65)), "max_tokens": 2000}).encode()
        # Virtual t=1000 lies inside the request's decode (>= 2000 s of it) and far past any cut the test
        # can make (seconds after the worker started): running there is 1 until the request is cancelled.
        running = lambda: http_json(f"http://127.0.0.1:{wp}/load?at=1000")["running"]  # noqa: E731
        with socket.create_connection(("127.0.0.1", wp), timeout=30) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_until(lambda: running() == 1, timeout=60, interval=0.05)
        wait_until(lambda: running() == 0, timeout=60, interval=0.05)
        with urllib.request.urlopen(f"http://127.0.0.1:{wp}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        assert 'kvatlas_worker_requests_total{worker="w0",outcome="cancelled"} 1' in metrics
    finally:
        w.stop()


def _metric(port: int, name: str, outcome: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(r'^%s\{worker="w0",outcome="%s"\} (\d+)$' % (name, outcome), text, re.M)
    assert m, text
    return int(m.group(1))


def _post(port: int, path: str, body: dict) -> socket.socket:
    raw = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
              % (path.encode(), len(raw), raw))
    return s


def _read_until(s: socket.socket, marker: bytes) -> bytes:
    got = b""
    while marker not in got:
        chunk = s.recv(65536)
        assert chunk, got
        got += chunk
    return got


@pytest.fixture(scope="module")
def openai_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    wp = free_port()
    sim = json.dumps({"decode_s_per_token": 1.0})
    w = Child("worker", [sys.executable, "-m", "cli.main", "--log-level", "WARNING", "worker", "--id", "w0",
                         "--port", str(wp), "--block-size", "16", "--gpu-pages", "256", "--speed", "1",
                         "--tokenizer", str(TINY_CHAT), "--sim", sim], tmp_path_factory.mktemp("openai_cancel"))
    try:
        wait_healthy([(w, f"http://127.0.0.1:{wp}")])
        yield wp
    finally:
        w.stop()


@pytest.mark.parametrize("path,stream", [("/v1/completions", True), ("/v1/completions", False),
                                         ("/v1/chat/completions", True), ("/v1/chat/completions", False)])
def test_an_openai_client_that_leaves_gives_its_batch_slot_back(openai_worker: int, path: str, stream: bool) -> None:
    wp = openai_worker
    body: dict = {"max_tokens": 2000, "stream": stream}
    if path == "/v1/completions":
        body["prompt"] = list(range(1, 65))
    else:
        body["messages"] = [{"role": "user", "content": "Routing a request to the worker that holds its prefix."}]
    # As in the /generate test: virtual t=1000 lies inside the request's >= 2000 s decode and past any
    # cut the test makes; running there is 1 until the request is cancelled.
    running = lambda: http_json(f"http://127.0.0.1:{wp}/load?at=1000")["running"]  # noqa: E731
    before = _metric(wp, "kvatlas_worker_openai_requests_total", "cancelled")
    assert running() == 0
    with _post(wp, path, body) as s:
        if stream:
            _read_until(s, b"data: ")  # the stream has begun: the client closes it mid-reply
        wait_until(lambda: running() == 1, timeout=60, interval=0.05)
    wait_until(lambda: running() == 0, timeout=60, interval=0.05)
    assert _metric(wp, "kvatlas_worker_openai_requests_total", "cancelled") == before + 1


def test_an_openai_stream_read_to_its_end_is_not_cancelled(openai_worker: int) -> None:
    wp = openai_worker
    before = {k: _metric(wp, "kvatlas_worker_openai_requests_total", k) for k in ("ok", "cancelled")}
    with _post(wp, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1, "stream": True}) as s:
        _read_until(s, b"data: [DONE]")
    wait_until(lambda: _metric(wp, "kvatlas_worker_openai_requests_total", "ok") == before["ok"] + 1,
               timeout=60, interval=0.05)
    assert _metric(wp, "kvatlas_worker_openai_requests_total", "cancelled") == before["cancelled"]
