"""The uvicorn protocol fast path for /score and /query (router_api.fasthttp) against uvicorn's own
path through the ASGI front: same bytes for the same requests, and the HTTP/1.1 cases the fast path
must get right on a real socket — keep-alive mixed with framework routes, pipelining, HTTP/1.0,
Expect: 100-continue, oversize bodies (declared and streamed), bearer auth."""
from __future__ import annotations

import socket
from typing import Iterator

import httpx
import msgspec
import numpy as np
import pytest

from support.service import serve_both_fronts
from router_api import fasthttp
from router_api.app import create_app
from cli.indexer import server_settings
from router_api.config import ServiceConfig
from router_api.service import IndexerService
from schemas.api import RegisterWorker

TOKEN = "s3cret"


class Served:
    """One service behind two real uvicorn servers: `fast` (the protocol fast path) and `asgi`."""

    def __init__(self, auth: str | None = None, max_body: int = 1 << 20) -> None:
        self.service = IndexerService(ServiceConfig(block_size=4, auth_token=auth, max_body_bytes=max_body))
        self.service.index.ensure_model("default", 4)
        self.service.registry.add(RegisterWorker(worker_id="w0", endpoint="tcp://127.0.0.1:1", block_size=4),
                                  self.service.clock())
        self.service.index.register_worker("default", "w0", 0)
        app = create_app(self.service)
        self.servers = serve_both_fronts(app)

    def port(self, name: str) -> int:
        return self.servers[name][2]

    def close(self) -> None:
        for server, t, _p in self.servers.values():
            server.should_exit = True
            t.join(10)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def test_fast_path_is_in_use() -> None:
    assert fasthttp.supported()
    assert issubclass(server_settings("127.0.0.1", 1)["http"], fasthttp.ScoreHttpProtocol)
    plain = server_settings("127.0.0.1", 1, fast_path=False)["http"]
    assert issubclass(plain, fasthttp.GuardedHttpProtocol) and not issubclass(plain, fasthttp.ScoreHttpProtocol)


REQUESTS = [
    ("POST", "/score", b'{"token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}', "application/json", None),
    ("POST", "/score", msgspec.msgpack.encode({"token_ids": [1, 2, 3, 4]}), "application/msgpack", "application/msgpack"),
    ("POST", "/score?model=default", np.arange(8, dtype="<u4").tobytes(), "application/octet-stream", None),
    ("POST", "/query", b'{"token_ids": [1, 2, 3, 4], "model_name": "default"}', "application/json", None),
    ("POST", "/score", b'{"token_ids": [1, 2', "application/json", None),
    ("POST", "/score", b'{"token_ids": [1], "model": "nope"}', "application/json", None),
    ("POST", "/score", b"", "application/json", None),
    ("POST", "/score", b"abc", "application/octet-stream", None),
    ("POST", "/score", b"{}", "text/plain", None),
    ("GET", "/score", b"", None, None),
    ("POST", "/query", b'{"token_ids": [4294967296]}', "application/json", None),
]


def test_same_answers_on_both_paths(served: Served) -> None:
    clients = {n: httpx.Client(base_url=f"http://127.0.0.1:{served.port(n)}") for n in ("fast", "asgi")}
    try:
        for method, path, body, ctype, accept in REQUESTS:
            h = {k: v for k, v in (("content-type", ctype), ("accept", accept)) if v}
            got = {n: c.request(method, path, content=body, headers=h) for n, c in clients.items()}
            a, b = got["fast"], got["asgi"]
            assert (a.status_code, a.content, a.headers.get("content-type")) == \
                (b.status_code, b.content, b.headers.get("content-type")), (path, body, a.text, b.text)
        # GET /health on the fast path: the FastAPI route's answer (uptime aside)
        ha, hb = clients["fast"].get("/health"), clients["asgi"].get("/health")
        assert ha.headers["content-type"] == hb.headers["content-type"] == "application/json"
        assert {**ha.json(), "uptime_s": 0} == {**hb.json(), "uptime_s": 0}
        # keep-alive: fast-path answers and framework routes interleaved on one connection
        c = clients["fast"]
        for i in range(60):
            r = (c.get("/health"), c.post("/score", content=b'{"token_ids": [1, 2, 3, 4]}'), c.get("/workers"))[i % 3]
            assert r.status_code == 200, r.text
    finally:
        for c in clients.values():
            c.close()


def _raw(port: int, data: bytes, want_responses: int) -> bytes:
    """Send raw bytes; read until `want_responses` responses arrived or the server closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while out.count(b"HTTP/1.1 ") < want_responses or not _complete(out):
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


def _complete(out: bytes) -> bool:
    """Every response in `out` has its whole content-length body."""
    rest = out
    while rest:
        head, sep, tail = rest.partition(b"\r\n\r\n")
        if not sep:
            return False
        n = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
        if len(tail) < n:
            return False
        rest = tail[n:]
    return True


def _post(path: bytes, body: bytes, extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return (b"POST " + path + b" HTTP/" + version + b"\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body)


def test_pipelined_and_http10(served: Served) -> None:
    body = b'{"token_ids": [1, 2, 3, 4]}'
    get = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    for port in (served.port("fast"), served.port("asgi")):
        out = _raw(port, get + _post(b"/score", body) + _post(b"/query", body) + get, 4)
        statuses = out.split(b"HTTP/1.1 ")[1:]
        assert len(statuses) == 4 and all(st.startswith(b"200 OK") for st in statuses), out[:400]
        heads = out.split(b"\r\n\r\n")
        assert b'"status"' in heads[1] and b'"workers"' in heads[2] and b'"instances"' in heads[3]
        old = _raw(port, _post(b"/score", body, version=b"1.0"), 1)
        assert old.startswith(b"HTTP/1.1 200") and b"connection: close" in old.lower()
        cont = _raw(port, _post(b"/score", body, extra=b"expect: 100-continue\r\n"), 2)
        assert b" 200 OK" in cont


def _health_answer(out: bytes) -> tuple[bytes, bool, dict]:
    """(status line, connection: close?, JSON body with the uptime zeroed) of one /health answer."""
    head, _sep, body = out.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    return lines[0], b"connection: close" in lines, {**msgspec.json.decode(body), "uptime_s": 0}


def test_health_one_read_heads(served: Served) -> None:
    # GET /health heads the one-read path takes (and some it leaves to httptools): the same answer and
    # connection handling on both servers; `connection: close` closes (`_raw` reads to the close)
    for head in (b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n", b"GET /health HTTP/1.1\r\n\r\n",
                 b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
                 b"GET /health HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n",
                 b"GET /health HTTP/1.0\r\nhost: x\r\n\r\n"):
        got = [_health_answer(_raw(served.port(n), head, 1)) for n in ("fast", "asgi")]
        assert got[0] == got[1] and got[0][0] == b"http/1.1 200 ok", (head, got)
        assert got[0][1] == (b"close" in head or b"1.0" in head), head
    # keep-alive: one-read /health answers between parsed requests on one connection
    with socket.create_connection(("127.0.0.1", served.port("fast")), timeout=10) as sock:
        for i in range(6):
            req = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n" if i % 2 else _post(b"/score", b'{"token_ids": [1]}')
            sock.sendall(req)
            out = b""
            while not out or not _complete(out):
                out += sock.recv(65536)
            assert out.startswith(b"HTTP/1.1 200"), out


def test_oversize_bodies_are_refused() -> None:
    s = Served(max_body=1000)
    try:
        for port in (s.port("fast"), s.port("asgi")):
            declared = _raw(port, b"POST /score HTTP/1.1\r\nhost: x\r\ncontent-length: 5000\r\n\r\n" + b"x" * 100, 1)
            assert declared.startswith(b"HTTP/1.1 413"), declared[:200]
            big = b'{"token_ids": [' + b"1," * 800 + b"1]}"
            chunked = (b"POST /score HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                       + b"".join(b"%x\r\n" % len(big[i:i + 500]) + big[i:i + 500] + b"\r\n" for i in range(0, len(big), 500))
                       + b"0\r\n\r\n")
            streamed = _raw(port, chunked, 1)
            assert streamed.startswith(b"HTTP/1.1 413"), streamed[:200]
        assert s.service.metrics.http_rejects.items()
    finally:
        s.close()


def test_bearer_auth_on_the_fast_path() -> None:
    s = Served(auth=TOKEN)
    try:
        for port in (s.port("fast"), s.port("asgi")):
            with httpx.Client(base_url=f"http://127.0.0.1:{port}") as c:
                body = b'{"token_ids": [1, 2, 3, 4]}'
                assert c.post("/score", content=body).status_code == 401
                assert c.post("/score", content=body, headers={"authorization": "Bearer nope"}).status_code == 401
                ok = c.post("/score", content=body, headers={"authorization": f"bearer {TOKEN}"})
                assert ok.status_code == 200 and ok.json()["workers"][0]["worker_id"] == "w0"
    finally:
        s.close()
