"""The one-read head parser (router_api/http_head.py) against httptools: every head `simple_post`
(or `simple_get`) takes is one httptools parses without error to the same method, target, version, (lower-case name,
value) pairs and keep-alive, ending at the same byte; heads outside its strict subset are left to
httptools (None)."""
from __future__ import annotations

from typing import Any

import httptools
import pytest
from hypothesis import given, settings, strategies as st

from indexer.core import native as native_core
from router_api import http_head
from router_api.http_head import fields, regex_get, regex_post, simple_get, simple_post


class _Seen:
    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.done = False
        self.parser: Any = None
        self.keep_alive: bool | None = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))  # as uvicorn's on_header keeps them

    def on_headers_complete(self) -> None:
        self.done = True
        # read here, as the fast path reads it: once the message completes the parser starts afresh
        self.keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()


def _httptools(head: bytes) -> tuple[Any, _Seen]:
    seen = _Seen()
    p = seen.parser = httptools.HttpRequestParser(seen)
    p.feed_data(head)
    return p, seen


def _same(data: bytes, get: bool = False) -> bool:
    """True when HEAD (GET_HEAD with `get`) takes `data` (and then httptools agrees); False when it
    leaves it."""
    got = (simple_get if get else simple_post)(data)
    if got is None:
        return False
    target, block, ctype, accept, clen, keep_alive, end = got
    headers = fields(block)
    p, seen = _httptools(data[:end])
    assert seen.done, data
    assert p.get_method() == (b"GET" if get else b"POST") and p.get_http_version() == "1.1"
    assert not get or clen is None  # a GET taken has no body to frame
    assert seen.url == target
    assert seen.headers == headers, data
    assert seen.keep_alive == keep_alive, data
    # the last of a repeated Content-Type or Accept counts, as the parser path's header loop reads them
    assert ctype == ([v for k, v in seen.headers if k == b"content-type"] or [None])[-1], data
    assert accept == ([v for k, v in seen.headers if k == b"accept"] or [None])[-1], data
    assert clen == ([v for k, v in seen.headers if k == b"content-length"] or [None])[-1], data
    assert clen is None or clen.isdigit()
    return True


TAKEN = [
    b"POST /score HTTP/1.1\r\nHost: 127.0.0.1:8700\r\nContent-Type: application/json\r\nContent-Length: 5\r\n\r\n",
    b"POST /query HTTP/1.1\r\nhost: x\r\naccept: application/msgpack\r\ncontent-length: 0\r\n\r\n",
    b"POST /score HTTP/1.1\r\nX-Empty:\r\nX-Tab:\tv\r\nX-Inner: a b\tc\r\n\r\n",
    b"POST /score HTTP/1.1\r\n\r\n",
    b"POST /score?model=m HTTP/1.1\r\nHost: x\r\n\r\n",  # taken; the route lookup then declines the target
    b"POST /score HTTP/1.1\r\nConnection: close\r\nContent-Length: 0012\r\n\r\n",
    b"POST /score HTTP/1.1\r\nconnection: Keep-Alive\r\n\r\n",
]
LEFT = [
    b"POST /score HTTP/1.0\r\nHost: x\r\n\r\n",  # HTTP/1.0: keep-alive rules differ
    b"post /score HTTP/1.1\r\n\r\n",
    b"GET /score HTTP/1.1\r\n\r\n",
    b"POST /score HTTP/1.1\nHost: x\n\n",  # bare LF
    b"POST /score HTTP/1.1\r\nHost : x\r\n\r\n",  # space before the colon
    b"POST /score HTTP/1.1\r\nHost: x \r\n\r\n",  # trailing whitespace
    b"POST /score HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n",  # obs-fold
    b"POST /score HTTP/1.1\r\nHost: \xc3\xa9\r\n\r\n",  # non-ASCII value
    b"POST /score HTTP/1.1\r\nHost: a\x7fb\r\n\r\n",  # DEL
    b"POST /score HTTP/1.1\r\nHost: a\x00b\r\n\r\n",
    b"POST  /score HTTP/1.1\r\n\r\n",
    b"POST /score HTTP/1.1\r\nHost: x\r\n",  # head not ended
    b"POST /score HTTP/1.1\r\nContent-Length:\r\n\r\n",  # empty Content-Length: httptools' 400
    b"POST /score HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
    b"POST /score HTTP/1.1\r\nContent-Length: +1\r\n\r\n",
    b"POST /score HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"POST /score HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n",
    b"POST /score HTTP/1.1\r\nExpect: 100-continue\r\n\r\n",
]


def test_known_heads() -> None:
    assert all(_same(h) for h in TAKEN)
    assert not any(_same(h) for h in LEFT)


GET_TAKEN = [
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:8700\r\n\r\n",
    b"GET /health HTTP/1.1\r\n\r\n",
    b"GET /health HTTP/1.1\r\nconnection: close\r\nUser-Agent: probe/1\r\n\r\n",
    b"GET /health?x=1 HTTP/1.1\r\nHost: x\r\n\r\n",  # taken; the fast path then declines the target
]
GET_LEFT = [
    b"GET /health HTTP/1.1\r\nContent-Length: 0\r\n\r\n",  # any framing of a body: httptools judges it
    b"GET /health HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"GET /health HTTP/1.0\r\n\r\n",
    b"GET /health HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x \r\n\r\n",
    b"POST /health HTTP/1.1\r\n\r\n",
    b"HEAD /health HTTP/1.1\r\n\r\n",
]


def test_known_get_heads() -> None:
    assert all(_same(h, get=True) for h in GET_TAKEN)
    assert not any(_same(h, get=True) for h in GET_LEFT)


_NAME = st.sampled_from([b"Host", b"Content-Type", b"content-length", b"Content-Length", b"Accept", b"X-A", b"Connection",
                         b"Transfer-Encoding", b"Expect", b"Authorization", b"a b", b"", b"X\x80", b"X:Y", b"ACCEPT",
                         b"Accept-Encoding", b"X-Content-Length", b"content-TYPE", b"Upgrade", b"connection"])
_VALUE = st.binary(max_size=12).map(lambda b: b.replace(b"\r\n", b"")) | st.sampled_from(
    [b"application/json", b" x", b"x ", b"\tx\t", b"a  b", b"close", b"keep-alive", b"Close", b"1\r\n x", b"",
     b"12", b"0", b"007", b"99999999999999999999999", b"1 2", b"chunked"])
_SEP = st.sampled_from([b": ", b":", b":\t", b" : ", b": \t"])
_EOL = st.sampled_from([b"\r\n", b"\r\n", b"\r\n", b"\n", b"\r"])


@settings(max_examples=400, deadline=None)
@given(line=st.sampled_from([b"POST /score HTTP/1.1", b"POST /query HTTP/1.1", b"POST /score HTTP/1.0",
                             b"POST /sc\x00re HTTP/1.1", b"POST / HTTP/1.1", b"POST /score HTTP/1.1 "]),
       hs=st.lists(st.tuples(_NAME, _SEP, _VALUE, _EOL), max_size=6), end=_EOL)
def test_generated_heads(line: bytes, hs: list[tuple[bytes, bytes, bytes, bytes]], end: bytes) -> None:
    data = line + b"\r\n" + b"".join(n + s + v + e for n, s, v, e in hs) + end
    _same(data)  # asserts agreement whenever the subset takes the head
    assert simple_post(data) == regex_post(data), data  # the C reading and the regexes'


def test_known_heads_c_and_regex() -> None:
    for h in TAKEN + LEFT + [b"POST /score HTTP/1.1\r\nAccept-Encoding: x\r\nAccept: a\r\naccept: B\r\n\r\n",
                             b"POST /score HTTP/1.1\r\nConnection: keep-alive\r\nconnection: close\r\n\r\n",
                             b"POST /score HTTP/1.1\r\nConnection: close\r\nConnection: x\r\n\r\n",
                             b"POST /score HTTP/1.1\r\nX-Content-Length: a\r\nContent-Type:  \tq\r\n\r\n"]:
        for x in (h, h + b"{}\r\n\r\n", h[:-1], h[:len(h) // 2], b"GET" + h[4:], b"GET" + h[4:] + b"x"):
            assert simple_post(x) == regex_post(x), x
            assert simple_get(x) == _regex_get(x), x


def _regex_get(data: bytes) -> Any:
    got = regex_get(data)
    return None if got is None or got[4] is not None else got


@pytest.mark.skipif(native_core.select(None) is None, reason="native module not built, or KVATLAS_PURE_PYTHON")
def test_the_c_reading_serves() -> None:
    """With the C module in use, simple_post / simple_get are its `simple_head` (the regexes its reference)."""
    assert http_head._native is not None

@settings(max_examples=300, deadline=None)
@given(line=st.sampled_from([b"GET /health HTTP/1.1", b"GET /health HTTP/1.0", b"GET /he\x00lth HTTP/1.1",
                             b"GET / HTTP/1.1", b"GET /health HTTP/1.1 "]),
       hs=st.lists(st.tuples(_NAME, _SEP, _VALUE, _EOL), max_size=6), end=_EOL)
def test_generated_get_heads(line: bytes, hs: list[tuple[bytes, bytes, bytes, bytes]], end: bytes) -> None:
    data = line + b"\r\n" + b"".join(n + s + v + e for n, s, v, e in hs) + end
    _same(data, get=True)
    assert simple_get(data) == _regex_get(data), data
