"""The router's raw HTTP front (router/proxy/front.py): the two routed paths answered from the
protocol, not through ASGI — the engine's Content-Length kept, a stream relayed as it comes,
keep-alive and pipelining, a body over the cap refused declared or streamed, a body that never
arrives cut at the read deadline, and anything else still served by the ASGI app behind it.
Real servers on loopback (test_router_ops's vLLM-shaped engines and router thread)."""
from __future__ import annotations

import json
import socket

import httpx

from router.proxy.core import ProxyCore
from support.net import read_until_closed
from test_router_ops import PROMPT, RouterThread, engines  # noqa: F401 (the fixture)


def _router(url: str, **kw: object) -> RouterThread:
    return RouterThread(lambda: ProxyCore({"a": url}, indexer=None, model="default", tokenizer=None,
                                          policy="round_robin"), **kw)


class _Reader:
    """HTTP/1.1 answers read off a socket in order (Content-Length or chunked bodies)."""

    def __init__(self, s: socket.socket) -> None:
        self.s, self.buf = s, b""

    def _until(self, mark: bytes) -> bytes:
        while mark not in self.buf:
            more = self.s.recv(65536)
            assert more, "closed early"
            self.buf += more
        got, _, self.buf = self.buf.partition(mark)
        return got

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            more = self.s.recv(65536)
            assert more, "closed early"
            self.buf += more
        got, self.buf = self.buf[:n], self.buf[n:]
        return got

    def answer(self) -> tuple[int, bytes]:
        head = self._until(b"\r\n\r\n").split(b"\r\n")
        fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in head[1:])}
        if b"content-length" in fields:
            return int(head[0].split()[1]), self._exactly(int(fields[b"content-length"]))
        body = b""
        while size := int(self._until(b"\r\n"), 16):
            body += self._exactly(size)
            assert self._exactly(2) == b"\r\n"
        assert self._exactly(2) == b"\r\n"
        return int(head[0].split()[1]), body


def test_hot_routes_keep_the_engines_framing_and_stream_as_it_comes(engines) -> None:
    a, slow = engines("a"), engines("slow", "slow_stream")
    with _router(a.url) as rt:
        r = httpx.post(f"{rt.url}/v1/chat/completions", json={"model": "default", "messages": [], "max_tokens": 1})
        assert r.status_code == 200 and r.json()["engine"] == "a"
        assert int(r.headers["content-length"]) == len(r.content)  # the ASGI path always streams chunked
        assert r.headers["x-kvatlas-worker"] == "a" and "unscored" in r.headers["x-kvatlas-route"]
        q = httpx.post(f"{rt.url}/v1/completions?x=1", json=PROMPT)  # not the fast path's: ASGI serves it alike
        assert q.status_code == 200 and q.json()["engine"] == "a" and "content-length" not in q.headers
    with _router(slow.url) as rt:
        with httpx.stream("POST", f"{rt.url}/v1/completions", json={**PROMPT, "stream": True}, timeout=10) as s:
            assert s.headers["transfer-encoding"] == "chunked"
            assert next(s.iter_raw()).startswith(b"data: ")  # the engine still has ~20 s of events to send


def test_keep_alive_and_pipelined_requests_are_answered_in_order(engines) -> None:
    a = engines("a")
    with _router(a.url) as rt:
        body = json.dumps(PROMPT).encode()
        req = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%b" % (len(body), body))
        health = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
        with socket.create_connection(("127.0.0.1", rt.port), timeout=10) as s:
            r = _Reader(s)
            s.sendall(req)
            assert r.answer()[0] == 200
            s.sendall(req + req + health + req)  # pipelined: the raw path, then uvicorn's, in order
            got = [r.answer() for _ in range(4)]
        assert [status for status, _ in got] == [200] * 4
        assert [json.loads(body).get("engine") for _, body in got] == ["a", "a", None, "a"]
        assert json.loads(got[2][1])["status"] == "degraded"  # (no indexer)
        metrics = httpx.get(f"{rt.url}/metrics").text
        assert 'kvatlas_router_requests_total{outcome="routed"} 4' in metrics


def test_bodies_over_the_cap_are_refused_declared_or_streamed(engines) -> None:
    a = engines("a")
    with _router(a.url, max_body_bytes=1000) as rt:
        with socket.create_connection(("127.0.0.1", rt.port), timeout=10) as s:  # declared: refused unread
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5000\r\n\r\n")
            got = s.recv(4096)
        assert got.startswith(b"HTTP/1.1 413") and b"byte limit" in got
        chunked = b"".join(b"%x\r\n%b\r\n" % (200, b" " * 200) for _ in range(8)) + b"0\r\n\r\n"
        with socket.create_connection(("127.0.0.1", rt.port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n" + chunked)
            got = s.recv(4096)
        assert got.startswith(b"HTTP/1.1 413")
        assert a.requests == 0
        assert httpx.post(f"{rt.url}/v1/completions", json=PROMPT).status_code == 200  # the server is fine


def test_a_client_still_sending_a_refused_body_reads_its_413(engines) -> None:
    """The 413 goes out before the body is read; the rest is read and dropped (a lingering close), so a
    client that sends its whole body first reads the answer instead of a connection reset."""
    a = engines("a")
    with _router(a.url, max_body_bytes=1000) as rt:
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", rt.port), timeout=10) as s:
                body = b"x" * 4_000_000
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body)
                          + body)
                got = read_until_closed(s)
            assert got.startswith(b"HTTP/1.1 413")
        assert a.requests == 0


def test_a_body_that_never_arrives_is_cut_at_the_read_deadline(engines) -> None:
    a = engines("a")
    with _router(a.url, request_timeout_s=0.5) as rt:
        with socket.create_connection(("127.0.0.1", rt.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"model\"")
            got = s.recv(4096)
        assert got == b"" or got.startswith(b"HTTP/1.1 408")
        assert a.requests == 0


def test_an_http10_or_closing_client_gets_its_answer_then_the_close(engines) -> None:
    a = engines("a")
    with _router(a.url) as rt:
        body = json.dumps(PROMPT).encode()
        for version, extra in ((b"1.0", b""), (b"1.1", b"connection: close\r\n")):
            with socket.create_connection(("127.0.0.1", rt.port), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/%b\r\nhost: x\r\n%bcontent-length: %d\r\n\r\n%b"
                          % (version, extra, len(body), body))
                got = b""
                while more := s.recv(65536):  # the server closes after the answer
                    got += more
            head, _, rest = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and b"connection: close" in head.lower()
            assert json.loads(rest)["engine"] == "a"
