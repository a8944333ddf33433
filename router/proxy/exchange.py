"""One routed OpenAI request, whichever server front carries it (router/proxy/front.py's raw
protocol for the hot routes, router/proxy/app.py's ASGI app for the rest and for what the raw
front leaves to it): read the JSON body, route, forward, and hand back either an opened upstream
answer (status, headers, body chunks to relay) or a refusal in OpenAI's error shape."""
from __future__ import annotations

from typing import Any, AsyncIterator, NamedTuple

import msgspec

from router.proxy.core import BadRequest, NoWorker, ProxyCore
from router.proxy.rawhttp import RawResponse

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()
# The paths routed and proxied, and whether each is a chat.
ROUTED = {"/v1/chat/completions": True, "/v1/completions": False}


class Refused(NamedTuple):
    """An answer the router gives itself (OpenAI's error shape, so client libraries raise as usual)."""

    status: int
    body: bytes


class Opened(NamedTuple):
    """The upstream answer, head read: `chunks` relays its body (and releases the route however it
    ends; raises core.Truncated when the engine broke off). `length`: the engine's Content-Length,
    None when it streams chunked or to the close."""

    status: int
    headers: dict[str, str]
    length: int | None
    chunks: AsyncIterator[bytes]


def refused(status: int, message: str, kind: str = "BadRequestError") -> Refused:
    return Refused(status, _enc.encode({"error": {"message": message, "type": kind, "code": status}}))


def too_large(max_body_bytes: int) -> Refused:
    return refused(413, f"body exceeds the {max_body_bytes}-byte limit")


def client_left() -> Refused:
    return refused(499, "the client disconnected")


def parse(core: ProxyCore, raw: bytes) -> dict[str, Any] | Refused:
    """The request's JSON object, or the 400 that answers it (counted)."""
    try:
        body = _dec.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        core.counts["bad_request"] += 1
        return refused(400, f"malformed JSON body: {exc}")
    if not isinstance(body, dict):
        core.counts["bad_request"] += 1
        return refused(400, "the body must be a JSON object")
    return body


async def open_routed(core: ProxyCore, path: str, raw: bytes, body: dict[str, Any],
                      headers: list[tuple[bytes, bytes]], chat: bool) -> Opened | Refused:
    """Route and forward; the upstream answer opened, or the router's own refusal (400, 503)."""
    try:
        route = await core.route(body, chat, len(raw))
        resp = await core.forward(path, raw, body, headers, route, chat)
    except BadRequest as exc:
        core.counts["bad_request"] += 1
        return refused(400, str(exc))
    except NoWorker as exc:
        core.counts["no_worker"] += 1
        return refused(503, str(exc), "ServiceUnavailable")
    length = resp.length if isinstance(resp, RawResponse) else None
    return Opened(resp.status_code, core.response_headers(resp, route), length, core.relay(resp, route))
