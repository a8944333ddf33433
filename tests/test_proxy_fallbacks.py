"""The OpenAI proxy never fails a request an engine would serve: without a tokenizer or with the
indexer down it routes on load; the body reaches the engine byte for byte (or, with
forward_token_ids, a text prompt as the scored ids); only "no worker is up" is a 503, naming why.
Engines here are real HTTP servers shaped like vLLM (metrics + an echoing completions route)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request, Response

from sim.httpbody import MAX_BODY_BYTES
from router_api.proxy.app import create_proxy_app
from router_api.proxy.core import ProxyCore
from router_api.tokenization import ChatTokenizer
from support.net import ThreadedServer, free_port
from support.tiny_tokenizer import TINY_CHAT

TOK = ChatTokenizer.from_dir(TINY_CHAT)


class Engine:
    """vLLM-shaped: /metrics with its gauge names; the OpenAI routes answer the raw body they got."""

    def __init__(self, name: str, waiting: int) -> None:
        app = FastAPI()

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(f'vllm:num_requests_running{{model_name="m"}} 0\n'
                            f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n', media_type="text/plain")

        @app.post("/v1/chat/completions")
        @app.post("/v1/completions")
        async def echo(request: Request) -> Response:
            return Response(json.dumps({"engine": name, "raw": (await request.body()).decode()}),
                            media_type="application/json", headers={"x-engine": name})

        self._http = ThreadedServer(app)
        self.url = self._http.url

    def stop(self) -> None:
        self._http.stop()


@pytest.fixture
def engines():
    e = {"busy": Engine("busy", waiting=50), "idle": Engine("idle", waiting=0)}
    yield e
    for x in e.values():
        x.stop()


async def _with_proxy(core: ProxyCore, fn) -> None:
    await core.start()
    try:
        transport = httpx.ASGITransport(app=create_proxy_app(core))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            await fn(c)
    finally:
        await core.close()


def test_routes_on_load_without_tokenizer_or_indexer(engines) -> None:
    workers = {w: e.url for w, e in engines.items()}
    dead_indexer = f"http://127.0.0.1:{free_port()}"
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "Hi \\u00e9"}],   "max_tokens": 3}'

    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 200
        assert r.json() == {"engine": "idle", "raw": raw.decode()}  # least backlog; the body unchanged
        assert r.headers["x-engine"] == "idle" and r.headers["x-kvatlas-worker"] == "idle"
        bad = await c.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
        big = await c.post("/v1/completions", content=b" " * (MAX_BODY_BYTES + 1),
                           headers={"content-type": "application/json"})
        assert big.status_code == 413 and "byte limit" in big.json()["error"]["message"]

    asyncio.run(_with_proxy(ProxyCore(workers, indexer=None, model="default", tokenizer=None,
                                      policy="precise_tiered"), check))

    async def check_tok(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 200
        route = dict(p.split("=", 1) for p in r.headers["x-kvatlas-route"].split("; "))
        assert int(route["prompt_tokens"]) == len(TOK.encode_chat(json.loads(raw)["messages"]))
        comp = await c.post("/v1/completions", json={"model": "m", "prompt": "The cache holds", "max_tokens": 1})
        sent = json.loads(comp.json()["raw"])
        assert sent["prompt"] == TOK.encode_prompt("The cache holds") and sent["add_special_tokens"] is False

    asyncio.run(_with_proxy(ProxyCore(workers, indexer=dead_indexer, model="default", tokenizer=TOK,
                                      policy="precise_tiered", forward_token_ids=True), check_tok))


def test_no_worker_up_is_a_503_naming_why() -> None:
    workers = {"a": f"http://127.0.0.1:{free_port()}", "b": f"http://127.0.0.1:{free_port()}"}

    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3]})
        assert r.status_code == 503
        msg = r.json()["error"]["message"]
        assert msg.startswith("no worker is up") and "a: metrics unreachable" in msg and "b: " in msg
        h = await c.get("/health")
        assert h.status_code == 503 and h.json()["workers"]["a"]["up"] is False

    asyncio.run(_with_proxy(ProxyCore(workers, indexer=None, model="default", tokenizer=None,
                                      policy="round_robin"), check))


def test_indexer_token_is_sent_and_a_refusal_is_unscored_not_failed() -> None:
    import numpy as np

    from router_api.config import ServiceConfig
    from support.service import LiveIndexer

    with LiveIndexer(ServiceConfig(port=free_port(), block_size=4, auth_token="sekret")) as idx:
        async def score(token: str | None) -> object:
            core = ProxyCore({"a": f"http://127.0.0.1:{free_port()}"}, indexer=idx.url, model="default",
                             tokenizer=None, policy="precise_tiered", indexer_token=token)
            try:
                return await core.score(np.asarray([1, 2, 3, 4], dtype="<u4"), {})
            finally:
                await core.close()

        assert asyncio.run(score("sekret")) == {}  # an answer (no worker registered yet)
        assert asyncio.run(score(None)) is None    # 401: routed on load, logged
