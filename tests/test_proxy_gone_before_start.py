"""The OpenAI proxy when its client leaves in the instant between the engine's answer head and the
response's start (issue 37, finding 13: routes are released however the response ends). Clean-up
that lives only in the response's body iterator must still run when the server learns of the hang-up
before that iterator starts (uvicorn's httptools protocol speaks ASGI spec 2.3: the response races a
watch for the disconnect): the worker's in-flight count is back to 0. Driven through the app's ASGI
interface, deterministically."""
from __future__ import annotations

import asyncio
import json

from router.proxy.app import create_proxy_app
from router.proxy.core import ProxyCore
from test_router_ops import Engine


def test_a_client_gone_before_the_response_starts_leaves_nothing_held() -> None:
    engine = Engine("a")
    body = json.dumps({"model": "default", "messages": [{"role": "user", "content": "hi"}]}).encode()

    async def main() -> dict[str, int]:
        core = ProxyCore({"a": engine.url}, indexer=None, model="default", tokenizer=None, policy="round_robin")
        await core.start()
        app = create_proxy_app(core)
        calls = 0

        async def receive() -> dict[str, object]:
            nonlocal calls
            calls += 1
            if calls == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            if calls == 2:  # the proxy's watch for a hang-up: nothing yet, while the engine answers
                await asyncio.Event().wait()
            return {"type": "http.disconnect"}  # then gone, before the response's first byte

        async def send(message: dict[str, object]) -> None:
            pass

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
                 "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"x"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        await app(scope, receive, send)
        held = dict(core.inflight)
        await core.close()
        return held

    try:
        held = asyncio.run(main())
    finally:
        engine.stop()
    assert engine.requests == 1
    assert held == {"a": 0}, held
