"""Request bodies of the indexer's HTTP service: the body kind from Content-Type, the typed msgspec
decoding, the C fast path for `/score` and `/query` token arrays (`TokenBodies`), raw u32 bodies
(`octet_tokens`), the declared-length check, and `ApiError`, the error every front answers as JSON."""
from __future__ import annotations

from types import ModuleType
from typing import Any

import msgspec
import numpy as np

from indexer.core import native as native_core
from schemas.api import (
    MAX_QUERY_TOKENS,
    QueryRequest,
    QueryRequestRaw,
    RegisterWorker,
    RouteAdmitted,
    RouteReport,
    RouteWait,
    ScoreRequest,
    ScoreRequestRaw,
)

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")

_dec_json: dict[type, msgspec.json.Decoder[Any]] = {
    t: msgspec.json.Decoder(t) for t in (ScoreRequest, QueryRequest, RegisterWorker)
}
_dec_msgpack: dict[type, msgspec.msgpack.Decoder[Any]] = {
    t: msgspec.msgpack.Decoder(t) for t in (ScoreRequest, QueryRequest, RegisterWorker)
}
for _t in (RouteReport, RouteAdmitted, RouteWait):
    _dec_json[_t] = msgspec.json.Decoder(_t)
    _dec_msgpack[_t] = msgspec.msgpack.Decoder(_t)
_RAW_TWIN: dict[type, type] = {ScoreRequest: ScoreRequestRaw, QueryRequest: QueryRequestRaw}
_dec_raw: dict[tuple[str, type], Any] = {
    ("json", t): msgspec.json.Decoder(r) for t, r in _RAW_TWIN.items()} | {
    ("msgpack", t): msgspec.msgpack.Decoder(r) for t, r in _RAW_TWIN.items()}


class ApiError(Exception):
    """An error answered as JSON; `reason` labels the reject counter. `loud`: also worth a log
    line (through the app's rate limiter), e.g. a body built to exhaust the decoder's stack."""

    def __init__(self, status: int, message: str, reason: str, loud: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.loud = loud


TOO_DEEP = "body nested too deeply"


def _too_deep() -> ApiError:
    return ApiError(400, f"malformed body: {TOO_DEEP}", "too_deep", loud=True)


def content_kind(ctype: str) -> str:
    """"json" | "msgpack" | "octet" for a Content-Type header value; ApiError(415) otherwise."""
    ctype = ctype.split(";", 1)[0].strip().lower()
    if ctype in ("application/json", "", "text/json"):
        return "json"
    if ctype in MSGPACK_TYPES:
        return "msgpack"
    if ctype == "application/octet-stream":
        return "octet"
    raise ApiError(415, f"unsupported content type {ctype!r}: use application/json, "
                        "application/msgpack or application/octet-stream", "bad_content_type")


def decode_body(kind: str, body: bytes, typ: type) -> Any:
    if not body:
        raise ApiError(400, "empty body", "empty_body")
    try:
        # a body type of a module that adds its own routes (router_api/decide.py) gets its decoder here
        if kind == "json":
            dec = _dec_json.get(typ) or _dec_json.setdefault(typ, msgspec.json.Decoder(typ))
            return dec.decode(body)
        mdec = _dec_msgpack.get(typ) or _dec_msgpack.setdefault(typ, msgspec.msgpack.Decoder(typ))
        return mdec.decode(body)
    except RecursionError:  # msgspec's nesting limit: the client's fault, not a 500
        raise _too_deep() from None
    except msgspec.ValidationError as exc:
        raise ApiError(422, f"invalid request: {exc}", "invalid") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # msgspec: invalid UTF-8 in a string
        reason = "bad_json" if kind == "json" else "bad_msgpack"
        raise ApiError(400, f"malformed {kind} body: {exc}", reason) from None


# A body holding token_ids and nothing else, up to the array (msgspec's and most clients' spelling).
_BARE_JSON = b'{"token_ids":'
_BARE_MSGPACK = b"\x81" + msgspec.msgpack.encode("token_ids")


class TokenBodies:
    """Decodes a /score or /query body to (request, token_ids). With the native module the tokens
    come back as a u32 numpy buffer parsed in C from the raw array; whenever the fast path cannot
    decide (any invalid or unusual input) the typed msgspec decoder judges the body, so statuses and
    messages are the pure-Python path's, word for word. Without it (or KVATLAS_PURE_PYTHON=1),
    that typed decoder is the only path and token_ids is a list of ints."""

    __slots__ = ("native", "msgpack_bodies")

    def __init__(self, native: bool | None = None) -> None:
        self.native: ModuleType | None = native_core.select(native)
        if self.native is not None and not hasattr(self.native, "json_body_u32"):
            self.native = None  # a stale build without the body parsers: the Python path serves
        self.msgpack_bodies = self.native is not None and hasattr(self.native, "msgpack_body_u32")

    def decode(self, kind: str, body: bytes, typ: type) -> tuple[Any, Any]:
        mod = self.native
        if mod is not None and body and (kind == "json" or (kind == "msgpack" and self.msgpack_bodies)):
            # One C pass finds and parses the token array; the typed decoder then judges the rest
            # of the body with that array replaced by an empty one (a few bytes, not a second full scan).
            js = kind == "json"
            found = mod.json_body_u32(body, MAX_QUERY_TOKENS) if js else mod.msgpack_body_u32(body, MAX_QUERY_TOKENS)
            if found is not None:
                buf, a, b = found
                if b == len(body) - (1 if js else 0) and body[:a] == (_BARE_JSON if js else _BARE_MSGPACK):
                    req = typ([])  # the body is token_ids alone: what the typed decoder would make of the rest
                else:
                    try:
                        req = (_dec_json if js else _dec_msgpack)[typ].decode(body[:a] + (b"[]" if js else b"\x90") + body[b:])
                    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
                        req = None  # judged below on the whole body, so the wording is the usual one
                if req is not None:
                    return req, np.frombuffer(buf, dtype=_U32)
        # The Raw twin keeps only the last of repeated keys, unvalidated, where the typed decoder
        # judges each occurrence: a body naming token_ids twice (or with a JSON escape that could
        # spell it) is left to the typed decoder.
        if mod is not None and body and body.count(b"token_ids") == 1 and (kind != "json" or b"\\" not in body):
            try:
                req = _dec_raw[kind, typ].decode(body)
            except (msgspec.DecodeError, UnicodeDecodeError):  # incl. ValidationError: the typed decoder words it
                req = None
            except RecursionError:
                raise _too_deep() from None
            if req is not None:
                parse = mod.json_u32_array if kind == "json" else mod.msgpack_u32_array
                buf = parse(req.token_ids, MAX_QUERY_TOKENS)
                if buf is not None:
                    return req, np.frombuffer(buf, dtype=_U32)
        req = decode_body(kind, body, typ)
        return req, req.token_ids


_U32 = np.dtype("<u4")  # built once: a dtype string is parsed again on every call (~0.35 us)


def octet_tokens(body: bytes | memoryview) -> np.ndarray:
    """Raw little-endian u32 tokens, viewed in place (no copy, no Python ints); empty = no tokens.
    `body` may be a view of the read that carried it (the protocol fast path's)."""
    if len(body) % 4:
        raise ApiError(422, f"octet-stream body of {len(body)} bytes is not a whole number of "
                            "little-endian u32 tokens", "invalid")
    if len(body) // 4 > MAX_QUERY_TOKENS:
        raise ApiError(422, f"{len(body) // 4} tokens exceeds the {MAX_QUERY_TOKENS}-token limit",
                       "invalid")
    return np.frombuffer(body, dtype=_U32)


def check_length(value: str | bytes | None, max_body: int) -> None:
    """A declared Content-Length above the limit is refused before any body is read."""
    if value is None:
        return
    try:
        n = int(value)
    except ValueError:
        raise ApiError(400, "invalid Content-Length", "bad_header") from None
    if n > max_body:
        raise ApiError(413, f"body of {n} bytes exceeds the {max_body}-byte limit", "too_large")
