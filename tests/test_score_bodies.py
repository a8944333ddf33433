"""The one-pass body parsers (`json_body_u32`, `msgpack_body_u32`: token_ids parsed in C, the rest judged
by the typed decoder with that span emptied) against the typed msgspec decoder alone, in process and
over many more bodies than tests/test_service_bodies.py sends through HTTP: valid bodies in every int
width, field order and extra field, and the same bytes mutated (cut, flipped, spliced). Either both
accept with the same request and tokens, or both refuse with the same status and words."""
from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.core import native as native_core
from router_api.bodies import ApiError, TokenBodies
from schemas.api import QueryRequest, ScoreRequest

pytestmark = pytest.mark.skipif(not native_core.available(), reason="native module not built")

NATIVE = TokenBodies(True)
PURE = TokenBodies(False)
N = native_core.select(True)


def mp_int(v: int, how: int) -> bytes:
    """v in its minimal msgpack form, or a wider / signed one (all valid msgpack)."""
    if how == 0 or v < 0:
        return msgspec.msgpack.encode(v)
    for code, nb in ((0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8), (0xD0, 1), (0xD1, 2), (0xD2, 4), (0xD3, 8))[how - 1:]:
        bits = 8 * nb - (1 if code >= 0xD0 else 0)
        if v < (1 << bits):
            return bytes([code]) + v.to_bytes(nb, "big")
    return msgspec.msgpack.encode(v)


TOKENS = st.lists(st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 127, 128, 255, 256, 65535, 65536,
                                                                        2**31, 2**32 - 1, 2**32, -1, -33])),
                  max_size=40)
EXTRA = st.dictionaries(st.sampled_from(["model", "model_name", "lora_name", "cache_salt", "other", "tokens"]),
                        st.one_of(st.text(max_size=6), st.none(), st.integers(-3, 3), st.lists(st.integers(-(2**63), 2**64 - 1), max_size=3)),
                        max_size=3)


@st.composite
def msgpack_bodies(draw: Any) -> bytes:
    toks = draw(TOKENS)
    how = draw(st.integers(0, 8))
    n = len(toks)
    head = bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
    if draw(st.booleans()) and n < 16:
        head = b"\xdc" + n.to_bytes(2, "big")  # a wider array header
    arr = head + b"".join(mp_int(t, how) for t in toks)
    extra = draw(EXTRA)
    pairs = [msgspec.msgpack.encode(k) + msgspec.msgpack.encode(v) for k, v in extra.items()]
    pairs.insert(draw(st.integers(0, len(pairs))), msgspec.msgpack.encode("token_ids") + arr)
    if draw(st.integers(0, 9)) == 0:
        pairs.append(msgspec.msgpack.encode("token_ids") + arr)  # repeated
    body = bytes([0x80 | len(pairs)]) + b"".join(pairs)
    return mutate(draw, body)


@st.composite
def json_bodies(draw: Any) -> bytes:
    body = msgspec.json.encode({"token_ids": draw(TOKENS), **draw(EXTRA)})
    return mutate(draw, body)


def mutate(draw: Any, body: bytes) -> bytes:
    how = draw(st.integers(0, 12))
    if how == 1 and body:
        return body[: draw(st.integers(0, len(body) - 1))]
    if how == 2 and body:
        i = draw(st.integers(0, len(body) - 1))
        return body[:i] + bytes([draw(st.integers(0, 255))]) + body[i + 1:]
    if how == 3:
        return body + draw(st.binary(min_size=1, max_size=3))
    if how == 4 and body:
        i = draw(st.integers(0, len(body)))
        return body[:i] + draw(st.binary(max_size=4)) + body[i:]
    return body


def outcome(tb: TokenBodies, kind: str, body: bytes, typ: type) -> Any:
    try:
        req, toks = tb.decode(kind, body, typ)
    except ApiError as exc:
        return ("error", exc.status, exc.message, exc.reason)
    fields = {f: getattr(req, f) for f in typ.__struct_fields__ if f != "token_ids"}
    return ("ok", fields, None if toks is None else [int(t) for t in toks])  # None: a prompt / messages body


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgpack_bodies(), st.sampled_from([ScoreRequest, QueryRequest]))
def test_msgpack_bodies_decode_like_the_typed_decoder(body: bytes, typ: type) -> None:
    assert outcome(NATIVE, "msgpack", body, typ) == outcome(PURE, "msgpack", body, typ)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_bodies(), st.sampled_from([ScoreRequest, QueryRequest]))
def test_json_bodies_decode_like_the_typed_decoder(body: bytes, typ: type) -> None:
    assert outcome(NATIVE, "json", body, typ) == outcome(PURE, "json", body, typ)


@pytest.mark.parametrize("kind,body", [
    # token_ids twice, the first out of u32 range: the typed decoder refuses it (hypothesis found
    # that the Raw twin kept only the last occurrence and accepted the body).
    ("msgpack", b"\x82\xa9token_ids\x91\xcf\x01\x00\x00\x00\x00\x00\x00\x00\xa9token_ids\x91\x00"),
    ("json", b'{"token_ids": [4294967296], "token_ids": [0]}'),
    ("json", b'{"token_ids": [4294967296], "token\\u005fids": [0]}'),
])
def test_repeated_token_ids_are_judged_like_the_typed_decoder(kind: str, body: bytes) -> None:
    assert outcome(NATIVE, kind, body, ScoreRequest) == outcome(PURE, kind, body, ScoreRequest)
    assert outcome(PURE, kind, body, ScoreRequest)[0] == "error"


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=64))
def test_msgpack_parser_on_any_bytes(body: bytes) -> None:
    """Never reads out of bounds (the sanitizer build runs this), and what it takes it takes whole."""
    found = N.msgpack_body_u32(body, 1000)
    if found is not None:
        buf, a, b = found
        assert 0 <= a < b <= len(body) and len(buf) % 4 == 0
    assert outcome(NATIVE, "msgpack", body, ScoreRequest) == outcome(PURE, "msgpack", body, ScoreRequest)


def test_msgpack_parser_takes_the_common_body() -> None:
    toks = list(range(0, 70000, 7))
    body = msgspec.msgpack.encode({"token_ids": toks, "model": "m"})
    buf, a, b = N.msgpack_body_u32(body, 10**6)
    assert body[a:b] == msgspec.msgpack.encode(toks)
    assert N.msgpack_body_u32(body, len(toks) - 1) is None  # over max_tokens: the typed decoder words it
    nested: Any = 1
    for _ in range(70):
        nested = [nested]
    deep = msgspec.msgpack.encode({"token_ids": [1], "x": nested})
    assert N.msgpack_body_u32(deep, 10) is None  # nested past the skipper's depth: undecided
