"""The head of a plain `POST` (or body-less `GET`) request that arrived whole in one read, read in
one C pass (`simple_head`, indexer/_native/bodies.c; without the C module, two compiled regexes)
instead of httptools' per-field callbacks (router_api/fasthttp.py's one-read path; docs/service.md,
"HTTP stack").

Only a strict subset is taken (`simple_post`, `simple_get`): the request line `POST <target>
HTTP/1.1` (`GET <target> HTTP/1.1`, with no `Content-Length` at all); header
names of token characters; values of visible ASCII with spaces or tabs inside, none trailing;
no `Transfer-Encoding`, `Upgrade` or `Expect`; `Connection` only `close` or `keep-alive`; at most
one `Content-Length`, all digits. Anything else — HTTP/1.0, obs-fold, control or non-ASCII bytes,
trailing whitespace, a bare LF, framing the subset does not read — is None, and the caller gives the
bytes to httptools unchanged, so every request the subset leaves out is judged exactly as before.
Every head it takes is one httptools parses without error to the same target, (name, value) pairs
and keep-alive, and the C and regex readings give the same SimpleHead for every input
(tests/test_http_head.py holds all three equal).
"""
from __future__ import annotations

import re
from typing import NamedTuple

from indexer.core import native as native_core

# The C reading of the same subset (`simple_head` in indexer/_native/bodies.c): ~0.6 us a head
# against ~5-6 us for the regexes below, which serve without the C module and are its reference
# (the index core warns once when the module is missing: not again here).
_native = getattr(native_core.select(None) if native_core.available() else None, "simple_head", None)

_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_VALUE = rb"(?:[!-~](?:[ \t!-~]*[!-~])?)?"  # visible ASCII; inner spaces and tabs; may be empty
_FIELDS = rb"((?:" + _TOKEN + rb":[ \t]*" + _VALUE + rb"\r\n)*)\r\n"
HEAD = re.compile(rb"POST (/[!-~]*) HTTP/1\.1\r\n" + _FIELDS)
GET_HEAD = re.compile(rb"GET (/[!-~]*) HTTP/1\.1\r\n" + _FIELDS)
FIELD = re.compile(rb"(" + _TOKEN + rb"):[ \t]*(" + _VALUE + rb")\r\n")


def fields(block: bytes) -> list[tuple[bytes, bytes]]:
    """The (lower-case name, value) pairs of a header block HEAD matched (its group 2), in order."""
    return [(k.lower(), v) for k, v in FIELD.findall(block)]


class SimpleHead(NamedTuple):
    """A head in the subset. `block` is HEAD's group 2, its fields each ending in CRLF (`fields` reads
    it as (name, value) pairs); `end` is the offset of the body. The C reading returns the same fields
    as a plain tuple, made a SimpleHead here (`_head`: tuple.__new__, no per-field work)."""

    target: bytes
    block: bytes
    content_type: bytes | None
    accept: bytes | None
    content_length: bytes | None
    keep_alive: bool
    end: int


_head = tuple.__new__


def simple_post(data: bytes) -> SimpleHead | None:
    """The head at the start of `data` when it is in the subset (module doc), else None. The last
    of a repeated Content-Type or Accept counts (as the fast path's header loop reads them)."""
    if _native is not None:
        got = _native(data, False)
        return None if got is None else _head(SimpleHead, got)
    return regex_post(data)


def simple_get(data: bytes) -> SimpleHead | None:
    """`simple_post` for a `GET` head: None also for any `Content-Length` (a body or a framing
    question is httptools' to judge)."""
    if _native is None:
        head = regex_get(data)
        return None if head is None or head.content_length is not None else head
    got = _native(data, True)
    return None if got is None or got[4] is not None else _head(SimpleHead, got)  # got[4]: the C tuple's length


def regex_post(data: bytes) -> SimpleHead | None:
    """`simple_post` by the regexes (without the C module; the reference the C reading is held to)."""
    m = HEAD.match(data)
    return None if m is None else _taken(m)


def regex_get(data: bytes) -> SimpleHead | None:
    """`regex_post` for a GET head (Content-Length not yet refused: `simple_get` does)."""
    m = GET_HEAD.match(data)
    return None if m is None else _taken(m)


def _taken(m: re.Match[bytes]) -> SimpleHead | None:
    """The head HEAD or GET_HEAD matched, read by the subset's rules (module doc); None outside them."""
    ctype = accept = clen = None
    keep_alive = True
    for k, v in fields(m[2]):
        if k == b"content-type":
            ctype = v
        elif k == b"accept":
            accept = v
        elif k == b"content-length":
            if clen is not None or not v.isdigit():
                return None
            clen = v
        elif k == b"connection":
            v = v.lower()
            if v == b"close":
                keep_alive = False
            elif v != b"keep-alive":
                return None
        elif k == b"transfer-encoding" or k == b"upgrade" or k == b"expect":
            return None
    return SimpleHead(m[1], m[2], ctype, accept, clen, keep_alive, m.end())
