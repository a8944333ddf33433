"""HTTP fuzzing with hypothesis through the real ASGI app (no network): random bodies, content
types, methods and paths. No 5xx, no crash, and rejected input never changes the index."""
from __future__ import annotations

import asyncio

import httpx
import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.net import free_port
from router_api.app import create_app
from router_api.config import ServiceConfig
from router_api.service import IndexerService

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["token_ids", "model", "model_name", "lora_name", "cache_salt", "worker_id",
                         "endpoint", "block_size", "dp_rank", "x"]), inner, max_size=4),
    max_leaves=20)
_bodies = st.one_of(
    _json_values.map(lambda v: msgspec.json.encode(v)),
    _json_values.map(lambda v: msgspec.msgpack.encode(v)),
    st.binary(max_size=64),
    st.integers(1, 3000).map(lambda d: b"[" * d),
    st.integers(1, 3000).map(lambda d: b'{"token_ids":' + b"[" * d + b"]" * d + b"}"),
)
_ctypes = st.sampled_from(["application/json", "application/msgpack", "application/octet-stream",
                           "text/plain", "", "application/json; charset=utf-8"])
_targets = st.sampled_from([("POST", "/score"), ("POST", "/query"), ("POST", "/workers"), ("GET", "/score"),
                            ("DELETE", "/workers/x"), ("DELETE", "/workers/a%2Fb"), ("GET", "/workers"),
                            ("POST", "/score?model=zz"), ("GET", "/nope%0aFORGED")])


def _service() -> IndexerService:
    svc = IndexerService(ServiceConfig(port=free_port(), block_size=4, stats_ttl_s=0.0))
    svc.index.ensure_model("default", 4)
    return svc


SVC = _service()
APPS = {native: create_app(SVC, native_bodies=native) for native in (True, False)}


@given(body=_bodies, ctype=_ctypes, target=_targets, native=st.booleans())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_http_fuzz_no_5xx_and_no_change_from_rejected_input(body: bytes, ctype: str, target: tuple[str, str],
                                                            native: bool) -> None:
    method, path = target
    before = SVC.dump()

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=APPS[native]), base_url="http://t") as c:
            return await c.request(method, path, content=body, headers={"content-type": ctype})

    r = asyncio.run(go())
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert SVC.dump() == before
    elif method == "POST" and path == "/workers":  # accepted: undo, the next example starts clean
        SVC.unregister(r.json()["worker_id"])
