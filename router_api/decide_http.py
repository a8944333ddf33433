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


def add_decide_routes(app: FastAPI, decider: Decider,
                      structured_body: Callable[[Request, type, str], Awaitable[Any]],
                      encode_for: Callable[..., Response], reject: Callable[[str, ApiError], Response],
                      observe: Callable[[str, float], None]) -> None:
    @app.post("/routes/decide")
    async def decide(request: Request) -> Response:
        """Score, choose and record the in-flight route in one step (router_api/decide.py)."""
        t0 = time.perf_counter()
        try:
            req = await structured_body(request, DecideRequest, "decide with a JSON or msgpack body")
            ans = decided(decider, req)
        except ApiError as exc:
            return reject("routes_decide", exc)
        observe("routes_decide", t0)
        return encode_for(request, ans)

    @app.post("/routes/release")
    async def release(request: Request) -> Response:
        """Forget many finished routes at once (routers batch their releases)."""
        try:
            req = await structured_body(request, ReleaseRequest, "release with a JSON or msgpack body")
        except ApiError as exc:
            return reject("routes_release", exc)
        return encode_for(request, decider.release(req))
