"""The head of a plain `POST` request that arrived whole in one read, parsed with two compiled
regexes instead of httptools' per-field callbacks (router_api/fasthttp.py's one-read path;
docs/service.md, "HTTP stack").

Only a strict subset is taken: the request line `POST <target> HTTP/1.1`; header names of token
characters; values of visible ASCII with single spaces or tabs inside, none leading or trailing
after the colon's optional whitespace. Anything else — HTTP/1.0, obs-fold, control or non-ASCII
bytes, trailing whitespace, a bare LF — does not match, and the caller gives the bytes to httptools
unchanged, so every request the subset leaves out is judged exactly as before. Every request it
takes is one httptools parses to the same method, target and (name, value) pairs (tests/test_http_head.py
holds the two equal).
"""
from __future__ import annotations

import re

_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_VALUE = rb"(?:[!-~](?:[ \t!-~]*[!-~])?)?"  # visible ASCII; inner spaces and tabs; may be empty
HEAD = re.compile(rb"POST (/[!-~]*) HTTP/1\.1\r\n((?:" + _TOKEN + rb":[ \t]*" + _VALUE + rb"\r\n)*)\r\n")
FIELD = re.compile(rb"(" + _TOKEN + rb"):[ \t]*(" + _VALUE + rb")\r\n")


def fields(block: bytes) -> list[tuple[bytes, bytes]]:
    """The (lower-case name, value) pairs of a header block HEAD matched (its group 2), in order."""
    return [(k.lower(), v) for k, v in FIELD.findall(block)]
