"""One HTTP stack: /openapi.json documents the front-served /score and /query exactly as accepted
(three body encodings, the raw body's query parameters, JSON or msgpack answers, the errors), and
the FastAPI routes behind those entries answer byte for byte like the front (async, in process,
httpx.AsyncClient over the ASGI apps)."""
from __future__ import annotations

from typing import Any, AsyncIterator

import httpx
import msgspec
import numpy as np
import pytest
import pytest_asyncio

from router_api.app import create_app
from router_api.config import ServiceConfig
from router_api.service import IndexerService
from schemas.api import RegisterWorker


def _service() -> IndexerService:
    svc = IndexerService(ServiceConfig(block_size=4))
    svc.index.ensure_model("default", 4)
    svc.registry.add(RegisterWorker(worker_id="w0", endpoint="tcp://127.0.0.1:1", block_size=4), svc.clock())
    svc.index.register_worker("default", "w0", 0)
    return svc


def _resolve(schema: dict[str, Any], node: Any) -> None:
    """Every $ref in `node` points at a component."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if ref is not None:
            name = ref.rsplit("/", 1)[-1]
            assert ref.startswith("#/components/schemas/") and name in schema["components"]["schemas"], ref
        for v in node.values():
            _resolve(schema, v)
    elif isinstance(node, list):
        for v in node:
            _resolve(schema, v)


def test_openapi_documents_score_and_query() -> None:
    schema = create_app(_service()).fastapi.openapi()
    for path, req, res in (("/score", "ScoreRequest", "ScoreResponse"), ("/query", "QueryRequest", "QueryResponse")):
        op = schema["paths"][path]["post"]
        content = op["requestBody"]["content"]
        assert set(content) == {"application/json", "application/msgpack", "application/octet-stream"}
        assert content["application/json"]["schema"] == {"$ref": f"#/components/schemas/{req}"}
        assert content["application/octet-stream"]["schema"] == {"type": "string", "format": "binary"}
        assert {p["name"] for p in op["parameters"] if p["in"] == "query"} == \
            {"model", "model_name", "lora_name", "cache_salt"}
        ok = op["responses"]["200"]["content"]
        assert set(ok) == {"application/json", "application/msgpack"}
        assert ok["application/json"]["schema"] == {"$ref": f"#/components/schemas/{res}"}
        assert {"400", "404", "413", "415", "422"} <= set(op["responses"])
    comps = schema["components"]["schemas"]
    # /score takes exactly one of token_ids, prompt or messages: none is required by the schema
    tokens = next(t for t in comps["ScoreRequest"]["properties"]["token_ids"]["anyOf"] if t["type"] == "array")
    assert tokens["items"]["maximum"] == 2 ** 32 - 1 and tokens["maxItems"] == 2_000_000
    assert {"prompt", "messages"} <= set(comps["ScoreRequest"]["properties"])
    assert not comps["ScoreRequest"].get("required")
    assert "token_ids" in comps["QueryRequest"]["required"]
    _resolve(schema, schema)


@pytest_asyncio.fixture
async def clients() -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    app = create_app(_service())
    front = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    routes = httpx.AsyncClient(transport=httpx.ASGITransport(app=app.fastapi), base_url="http://t")
    async with front, routes:
        yield front, routes


CASES = [
    ("/score", b'{"token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}', "application/json", None),
    ("/score", msgspec.msgpack.encode({"token_ids": [1, 2, 3, 4]}), "application/msgpack", "application/msgpack"),
    ("/score?model=default&lora_name=", np.arange(8, dtype="<u4").tobytes(), "application/octet-stream", None),
    ("/query", b'{"token_ids": [1, 2, 3, 4], "model": "default"}', "application/json", None),
    ("/score", b'{"token_ids": [1', "application/json", None),
    ("/score", b'{"token_ids": [1], "model": "nope"}', "application/json", None),
    ("/score", b"", "application/json", None),
    ("/score", b"123", "application/octet-stream", None),
    ("/score", b"{}", "text/plain", None),
    ("/query", b'{"token_ids": [-1]}', "application/json", None),
    ("/score", b"[" * 5000 + b"]" * 5000, "application/json", None),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("path,body,ctype,accept", CASES)
async def test_fastapi_routes_answer_like_the_front(clients: tuple[httpx.AsyncClient, httpx.AsyncClient], path: str,
                                                    body: bytes, ctype: str, accept: str | None) -> None:
    front, routes = clients
    h = {"content-type": ctype, **({"accept": accept} if accept else {})}
    a = await front.post(path, content=body, headers=h)
    b = await routes.post(path, content=body, headers=h)
    assert (a.status_code, a.content, a.headers["content-type"]) == \
        (b.status_code, b.content, b.headers["content-type"]), (a.text, b.text)


@pytest.mark.asyncio
async def test_invalid_utf8_in_a_string_is_a_400(clients: tuple[httpx.AsyncClient, httpx.AsyncClient]) -> None:
    """msgspec reports invalid UTF-8 as UnicodeDecodeError, not DecodeError: still the client's fault."""
    front, routes = clients
    for client in (front, routes):
        for path, body in (("/score", b'{"token_ids": [1], "model": "\x80"}'), ("/query", b'{"token_ids": [1], "model": "\xff"}'),
                           ("/workers", b'{"worker_id": "\x80", "endpoint": "tcp://127.0.0.1:5"}')):
            r = await client.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and "malformed json body" in r.json()["error"], (path, r.text)
