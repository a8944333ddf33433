"""HTTP glue of router_api/decide.py: `POST /routes/decide` and `POST /routes/release` on the
indexer's FastAPI app (JSON or msgpack bodies, answered in the format the client accepts)."""
from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from router_api.bodies import ApiError
from router_api.decide import DecideError, DecideRequest, Decider, NoChooser, ReleaseRequest


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
            ans = decider.decide(req)
        except ApiError as exc:
            return reject("routes_decide", exc)
        except DecideError as exc:
            return reject("routes_decide", ApiError(422, str(exc), "invalid"))
        except NoChooser as exc:
            return reject("routes_decide", ApiError(501, str(exc), "no_chooser"))
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
