"""HTTP glue of router_api/decide.py: `POST /routes/decide` and `POST /routes/release` on the
indexer's FastAPI app (JSON or msgpack bodies, answered in the format the client accepts); the decide
route is also served by the score front ahead of FastAPI and on the protocol fast path (`decide_route`)."""
from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from router_api.bodies import ApiError
from router_api.decide import DecideAnswer, DecideError, DecideRequest, Decider, NoChooser, ReleaseRequest
from router_api.score_front import Route

_json = msgspec.json.Encoder()
_msgpack = msgspec.msgpack.Encoder()


def decided(decider: Decider, req: DecideRequest) -> DecideAnswer:
    """The decision, or the ApiError that answers the request (422 invalid, 501 no chooser)."""
    try:
        return decider.decide(req)
    except DecideError as exc:
        raise ApiError(422, str(exc), "invalid") from None
    except NoChooser as exc:
        raise ApiError(501, str(exc), "no_chooser") from None


def decide_route(decider: Decider) -> Route:
    """`POST /routes/decide` as a ScoreFront route: served ahead of FastAPI and on the indexer's
    protocol fast path (router_api/fasthttp.py), as `/score` is."""
    def answer(req: DecideRequest, mp: bool) -> bytes:
        return (_msgpack if mp else _json).encode(decided(decider, req))
    return Route("routes_decide", DecideRequest, answer, structured=True)


def add_structured_post(app: FastAPI, path: str, name: str, body_type: type, what: str,
                        handle: Callable[[Any], Any],
                        structured_body: Callable[[Request, type, str], Awaitable[Any]],
                        encode_for: Callable[..., Response], reject: Callable[[str, ApiError], Response],
                        observe: Callable[[str, float], None] | None = None, doc: str = "") -> None:
    """`POST path`: a JSON or msgpack body of `body_type` -> `handle` -> the answer in the format the
    client accepts; an ApiError from either is the answer (counted under `name`), `observe` times it."""
    async def endpoint(request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            ans = handle(await structured_body(request, body_type, what))
        except ApiError as exc:
            return reject(name, exc)
        if observe is not None:
            observe(name, t0)
        return encode_for(request, ans)

    endpoint.__doc__ = doc
    app.add_api_route(path, endpoint, methods=["POST"], name=name)


def add_decide_routes(app: FastAPI, decider: Decider,
                      structured_body: Callable[[Request, type, str], Awaitable[Any]],
                      encode_for: Callable[..., Response], reject: Callable[[str, ApiError], Response],
                      observe: Callable[[str, float], None]) -> None:
    add_structured_post(app, "/routes/decide", "routes_decide", DecideRequest, "decide with a JSON or msgpack body",
                        lambda req: decided(decider, req), structured_body, encode_for, reject, observe,
                        "Score, choose and record the in-flight route in one step (router_api/decide.py).")
    add_structured_post(app, "/routes/release", "routes_release", ReleaseRequest,
                        "release with a JSON or msgpack body", decider.release, structured_body, encode_for, reject,
                        doc="Forget many finished routes at once and apply admission reports (routers batch them).")
