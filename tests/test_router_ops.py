"""The OpenAI router under the findings of issues 32 and 37: honest health and headers with the
indexer down, per-worker route refusals, a missing endpoint retried, the metrics poll's total
deadline and size cap, the first-byte deadline, client disconnects cancelling upstream work and
releasing routes, a truncated stream cut at the client, bad bodies answered 4xx, tokenization off
the loop, and the server's head deadline and connection cap. Real servers on loopback: the
indexer in process (support.service.LiveIndexer), engines shaped like vLLM, the router's own
uvicorn server with its guarded protocol."""
from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import httpx
import msgspec
import pytest
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from router.proxy.cmd import build_server
from router.proxy.core import ProxyCore
from router_api.config import ServiceConfig
from router_api.tokenization import ChatTokenizer
from support.net import ThreadedServer, free_port, wait_until
from support.service import LiveIndexer
from support.tiny_tokenizer import TINY_CHAT

TOK = ChatTokenizer.from_dir(TINY_CHAT)


class Engine:
    """vLLM-shaped: gauges on /metrics; the OpenAI routes answer per `mode`, and record whether
    the router's connection went away before the answer ended (`cancelled`)."""

    def __init__(self, name: str, mode: str = "ok", cached: int = 0) -> None:
        self.name = name
        self.mode = mode
        self.cancelled = threading.Event()
        self.requests = 0
        app = FastAPI()

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response('vllm:num_requests_running{model_name="m"} 0\n'
                            'vllm:num_requests_waiting{model_name="m"} 0\n', media_type="text/plain")

        @app.post("/v1/chat/completions")
        @app.post("/v1/completions")
        async def answer(request: Request) -> Response:
            self.requests += 1
            body = await request.json()
            if self.mode == "hang":  # accepts, never answers; notes when the router hangs up
                while not await request.is_disconnected():
                    await asyncio.sleep(0.02)
                self.cancelled.set()
                return Response(status_code=499)
            if self.mode == "cut" and body.get("stream"):
                async def cut() -> Any:
                    yield b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
                    await asyncio.sleep(0.05)
                    raise RuntimeError("engine died mid-answer")
                return StreamingResponse(cut(), media_type="text/event-stream")
            if self.mode == "slow_stream" and body.get("stream"):
                async def slow() -> Any:
                    for _ in range(400):
                        yield b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
                        await asyncio.sleep(0.05)
                return StreamingResponse(slow(), media_type="text/event-stream")
            return Response(json.dumps({"engine": name, "usage": {"prompt_tokens": 1, "prompt_tokens_details":
                                                                   {"cached_tokens": cached}}}),
                            media_type="application/json")

        self._http = ThreadedServer(app)
        self.url = self._http.url

    def stop(self) -> None:
        self._http.stop()


class RouterThread:
    """The router's own server (router.proxy.cmd.build_server) in a thread with its own loop."""

    def __init__(self, make_core: Callable[[], ProxyCore], **server_kw: Any) -> None:
        self.port = free_port()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.url = f"http://127.0.0.1:{self.port}"
        self.core: ProxyCore | None = None
        self.server: Any = None
        self._kw = {"max_body_bytes": 8 << 20, **server_kw}
        self._make = make_core
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()
        wait_until(lambda: self.server is not None and self.server.started, timeout=30)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        core = self.core = self._make()
        await core.start()
        server, sock = build_server(core, "127.0.0.1", self.port, **self._kw)
        self.server = server
        try:
            await server.serve(sockets=[sock])
        finally:
            await core.close()

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self.thread.join(15)

    def __enter__(self) -> RouterThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _route(r: httpx.Response) -> dict[str, str]:
    return dict(p.split("=", 1) for p in r.headers["x-kvatlas-route"].split("; "))


def _register(idx: LiveIndexer, *workers: str) -> None:
    for w in workers:
        r = idx.client.post("/workers", json={"worker_id": w, "endpoint": f"tcp://127.0.0.1:{free_port()}",
                                              "model": "default", "block_size": 4})
        assert r.status_code == 201, r.text


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(name: str, mode: str = "ok", cached: int = 0) -> Engine:
        e = Engine(name, mode, cached)
        made.append(e)
        return e

    yield make
    for e in made:
        e.stop()


@contextmanager
def precise_router_over(engine: Any, worker: str) -> Iterator[tuple[LiveIndexer, RouterThread]]:
    """An indexer with `worker` registered and a precise_tiered router in front of `engine` alone."""
    with LiveIndexer(ServiceConfig(port=free_port(), block_size=4)) as idx:
        _register(idx, worker)
        with RouterThread(lambda: ProxyCore({worker: engine.url}, indexer=idx.url, model="default", tokenizer=None,
                                            policy="precise_tiered")) as rt:
            yield idx, rt


PROMPT = {"model": "default", "prompt": list(range(1, 41)), "max_tokens": 1}


def test_indexer_down_is_degraded_and_unscored_then_ok(engines) -> None:
    a = engines("a")
    port = free_port()
    with RouterThread(lambda: ProxyCore({"a": a.url}, indexer=f"http://127.0.0.1:{port}", model="default",
                                        tokenizer=TOK, policy="precise_tiered")) as rt:
        c = httpx.Client(base_url=rt.url, timeout=10)
        r = c.post("/v1/completions", json=PROMPT)
        assert r.status_code == 200
        route = _route(r)
        assert route["predicted_cached_tokens"] == "unscored" and route["unscored"].startswith("indexer_unreachable")
        h = c.get("/health")
        assert h.status_code == 200 and h.json()["status"] == "degraded"
        assert any("unreachable" in why for why in h.json()["why"])
        with LiveIndexer(ServiceConfig(port=port, block_size=4)) as idx:
            _register(idx, "a")
            r = c.post("/v1/completions", json=PROMPT)
            assert _route(r)["predicted_cached_tokens"] == "0"  # scored: nothing cached anywhere yet
            assert c.get("/health").json()["status"] == "ok"
            assert 'kvatlas_router_indexer_up 1' in c.get("/metrics").text


def test_a_worker_the_indexer_does_not_know_never_stops_reporting_for_others(engines) -> None:
    a, ghost = engines("a"), engines("ghost")
    with LiveIndexer(ServiceConfig(port=free_port(), block_size=4)) as idx:
        _register(idx, "a")
        with RouterThread(lambda: ProxyCore({"a": a.url, "ghost": ghost.url}, indexer=idx.url, model="default",
                                            tokenizer=None, policy="round_robin")) as rt:
            c = httpx.Client(base_url=rt.url, timeout=10)
            for _ in range(6):  # round robin: three go to the unregistered id
                assert c.post("/v1/completions", json=PROMPT).status_code == 200
            assert ghost.requests == 3 and a.requests == 3
            assert rt.core is not None and rt.core.indexer is not None
            assert rt.core.indexer.unknown_workers == {"ghost": 3}
            assert idx.service.routes.pending.counts.added == 3  # every route to the registered worker
            assert 'kvatlas_router_route_refused_total{worker="ghost"} 3' in c.get("/metrics").text


def test_an_indexer_without_the_decide_endpoint_is_retried_with_backoff(engines) -> None:
    a = engines("a")
    app = FastAPI()
    calls = {"decide": 0, "score": 0}

    @app.post("/routes/decide")
    async def missing() -> Response:
        calls["decide"] += 1
        return Response('{"detail":"Not Found"}', status_code=404)

    @app.post("/score")
    async def score() -> Response:
        calls["score"] += 1
        return Response(msgspec.msgpack.encode({"model": "default", "block_size": 4, "workers": []}),
                        media_type="application/msgpack")

    old = ThreadedServer(app)
    try:
        with RouterThread(lambda: ProxyCore({"a": a.url}, indexer=old.url, model="default", tokenizer=None,
                                            policy="precise_tiered")) as rt:
            c = httpx.Client(base_url=rt.url, timeout=10)
            for _ in range(3):
                r = c.post("/v1/completions", json=PROMPT)
                assert r.status_code == 200 and _route(r)["predicted_cached_tokens"] == "0"  # from /score
            assert calls["decide"] == 1 and calls["score"] == 3  # backing off, not off for good
            assert rt.core is not None and rt.core.indexer is not None
            rt.core.indexer._missing_until = 0.0  # the backoff ran out
            c.post("/v1/completions", json=PROMPT)
            assert calls["decide"] == 2
    finally:
        old.stop()


def test_metrics_poll_has_a_total_deadline_and_a_size_cap_per_worker() -> None:
    app = FastAPI()

    @app.get("/metrics")
    async def drip() -> StreamingResponse:
        async def body() -> Any:
            for _ in range(1000):
                yield b"#"
                await asyncio.sleep(0.1)
        return StreamingResponse(body(), media_type="text/plain")

    big = FastAPI()

    @big.get("/metrics")
    async def huge() -> Response:
        return Response(b"# " + b"x" * (2 << 20), media_type="text/plain")

    ok = Engine("ok")
    dripping, large = ThreadedServer(app), ThreadedServer(big)
    try:
        from router.proxy.load import LoadPoller

        async def run() -> dict[str, str]:
            async with httpx.AsyncClient() as client:
                p = LoadPoller({"drip": dripping.url, "big": large.url, "ok": ok.url}, client, interval_s=0.05,
                               timeout_s=0.5, max_bytes=1 << 20)
                await asyncio.wait_for(p.poll_all(), 5.0)  # the drip is cut off by the total deadline
                checks = p.states["ok"].checks
                p.start()
                await asyncio.sleep(1.2)  # the drip's next polls hang to their deadline; ok's go on
                assert p.states["ok"].checks >= checks + 5
                await p.close()
                return {w: f"{st.up} {st.reason}" for w, st in p.states.items()}

        states = asyncio.run(run())
        assert states["drip"].startswith("False metrics took longer than 0.5s")
        assert states["big"].startswith("False metrics refused: metrics larger than")
        assert states["ok"] == "True ok"
    finally:
        dripping.stop()
        large.stop()
        ok.stop()


def test_an_engine_that_never_answers_is_left_at_the_first_byte_deadline(engines) -> None:
    hang, good = engines("hang", "hang"), engines("good")
    with RouterThread(lambda: ProxyCore({"hang": hang.url, "good": good.url}, indexer=None, model="default",
                                        tokenizer=None, policy="round_robin", first_byte_timeout_s=0.5)) as rt:
        c = httpx.Client(base_url=rt.url, timeout=30)
        answers = [c.post("/v1/completions", json=PROMPT) for _ in range(4)]
        assert all(r.status_code == 200 and r.headers["x-kvatlas-worker"] == "good" for r in answers)
        assert hang.cancelled.wait(5)  # the abandoned request was closed upstream
        metrics = c.get("/metrics").text
        assert 'kvatlas_router_requests_total{outcome="first_byte_timeouts"} 1' in metrics  # then marked down


def test_a_client_that_leaves_cancels_the_engine_and_releases_its_route(engines) -> None:
    hang = engines("hang", "hang")
    with precise_router_over(hang, "hang") as (idx, rt):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{rt.url}/v1/completions", json=PROMPT, timeout=0.5)  # not streamed, then gone
        assert hang.cancelled.wait(5)
        wait_until(lambda: idx.service.routes.pending.counts.released == 1, timeout=5)


def test_a_dropped_stream_releases_its_route(engines) -> None:
    slow = engines("slow", "slow_stream")
    with precise_router_over(slow, "slow") as (idx, rt):
        for _ in range(3):
            with httpx.stream("POST", f"{rt.url}/v1/completions", json={**PROMPT, "stream": True},
                              timeout=10) as s:
                assert next(s.iter_raw())  # one event, then the client goes
        wait_until(lambda: idx.service.routes.pending.counts.released == 3, timeout=10)


def test_a_stream_the_engine_cuts_is_cut_at_the_client(engines) -> None:
    cut = engines("cut", "cut")
    with RouterThread(lambda: ProxyCore({"cut": cut.url}, indexer=None, model="default", tokenizer=None,
                                        policy="round_robin")) as rt:
        with pytest.raises(httpx.RemoteProtocolError):
            with httpx.stream("POST", f"{rt.url}/v1/completions", json={**PROMPT, "stream": True}, timeout=10) as s:
                s.read()
        assert 'outcome="truncated"} 1' in httpx.get(f"{rt.url}/metrics").text


def test_hostile_bodies_are_4xx_not_500(engines) -> None:
    a = engines("a")
    with RouterThread(lambda: ProxyCore({"a": a.url}, indexer=None, model="default", tokenizer=TOK,
                                        policy="round_robin")) as rt:
        c = httpx.Client(base_url=rt.url, timeout=30)
        deep = b'{"model": "m", "prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
        r = c.post("/v1/completions", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "chat_template_kwargs": ["not", "an", "object"]})
        assert r.status_code == 400 and "chat_template_kwargs" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 200


class SlowTokenizer(ChatTokenizer):
    """Encoding a big chat takes a while (CPU-bound, GIL released like the Rust tokenizer's)."""

    def encode_chat(self, messages: Any, **kw: Any) -> list[int]:
        if len(json.dumps(messages)) > 100_000:
            time.sleep(1.5)
        return super().encode_chat(messages, **kw)


def test_a_big_chat_is_tokenized_off_the_loop(engines) -> None:
    a = engines("a")
    slow = SlowTokenizer.from_dir(TINY_CHAT)
    with RouterThread(lambda: ProxyCore({"a": a.url}, indexer=None, model="default", tokenizer=slow,
                                        policy="round_robin", tokenize_threads=1)) as rt:
        done: list[str] = []

        def big() -> None:
            httpx.post(f"{rt.url}/v1/chat/completions", timeout=30, json={
                "model": "m", "messages": [{"role": "user", "content": "word " * 40_000}]})
            done.append("big")

        t = threading.Thread(target=big)
        t.start()
        wait_until(lambda: a.requests == 0 and rt.core is not None and rt.core._tok_slots.locked(), timeout=10)
        assert httpx.get(f"{rt.url}/health", timeout=30).status_code == 200
        done.append("health")
        t.join(30)
        assert done == ["health", "big"]


def test_slow_heads_are_cut_and_connections_capped(engines) -> None:
    a = engines("a")
    with RouterThread(lambda: ProxyCore({"a": a.url}, indexer=None, model="default", tokenizer=None,
                                        policy="round_robin"), request_timeout_s=0.5, max_connections=4) as rt:
        slow = socket.create_connection(("127.0.0.1", rt.port))
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never ends its head
        slow.settimeout(10)
        got = slow.recv(4096)
        assert got == b"" or b" 408 " in got.split(b"\r\n", 1)[0]  # cut at the deadline
        slow.close()
        held = [socket.create_connection(("127.0.0.1", rt.port)) for _ in range(6)]
        try:
            refused = 0
            for s in held:
                s.settimeout(5)
                try:
                    first = s.recv(64)
                except socket.timeout:
                    continue
                refused += first.startswith(b"HTTP/1.1 503")
            assert refused == 2  # over the cap of 4
        finally:
            for s in held:
                s.close()
        metrics = httpx.get(f"{rt.url}/metrics", timeout=10).text  # both kinds of refusal counted
        assert 'kvatlas_router_http_rejects_total{reason="connection_limit"} 2' in metrics
        cut = re.search(r'^kvatlas_router_http_rejects_total\{reason="request_timeout"\} (\d+)$', metrics, re.M)
        assert cut is not None and int(cut.group(1)) >= 1  # the slow head (the held ones may follow it)


def test_workers_are_learned_from_the_registry_and_routed_by_model(engines) -> None:
    """Workers (id, url, model) come from the indexer's `GET /workers`; a `--worker` flag wins for its
    id; requests go to the workers serving their `model`."""
    from router.proxy.cmd import learn_workers

    a, b, pinned = engines("a"), engines("b"), engines("pinned")
    app = FastAPI()

    @app.get("/workers")
    async def workers() -> Response:
        return Response(json.dumps({"workers": [
            {"worker_id": "a", "url": a.url, "model": "llama"}, {"worker_id": "b", "url": b.url, "model": "qwen"},
            {"worker_id": "p", "url": "http://127.0.0.1:1", "model": "qwen"}, {"worker_id": "old"},
            {"worker_id": "bad", "url": "file:///etc/passwd", "model": "qwen"}]}), media_type="application/json")

    reg = ThreadedServer(app)
    try:
        def make() -> ProxyCore:
            return ProxyCore({"p": pinned.url}, indexer=None, model="default", tokenizer=None, policy="round_robin",
                             worker_models={"p": "qwen"})

        with RouterThread(make) as rt:
            assert rt.core is not None
            core = rt.core
            fut = asyncio.run_coroutine_threadsafe(
                learn_workers(core, reg.url, None, {"p": pinned.url}, core.client), rt.loop)
            assert fut.result(10) == 2
            assert core.workers == {"p": pinned.url, "a": a.url, "b": b.url}
            wait_until(lambda: set(core.poller.up()) == {"p", "a", "b"}, timeout=10)
            c = httpx.Client(base_url=rt.url, timeout=10)
            got = {c.post("/v1/completions", json={**PROMPT, "model": m}).headers["x-kvatlas-worker"]
                   for m in ("llama", "llama", "qwen", "qwen", "qwen", "qwen")}
            assert got == {"a", "b", "p"}
            assert a.requests == 2 and b.requests + pinned.requests == 4 and pinned.requests > 0
    finally:
        reg.stop()


def test_several_routers_share_a_port_with_reuse_port(engines) -> None:
    a = engines("a")

    def make() -> ProxyCore:
        return ProxyCore({"a": a.url}, indexer=None, model="default", tokenizer=None, policy="round_robin")

    first = RouterThread(make, reuse_port=True)
    try:
        second_core = make()
        server, sock = build_server(second_core, "127.0.0.1", first.port, max_body_bytes=1 << 20, reuse_port=True)
        sock.close()  # bound beside the first: the kernel would spread connections over both
        with pytest.raises(OSError):
            build_server(second_core, "127.0.0.1", first.port, max_body_bytes=1 << 20)  # without it: in use
        assert httpx.post(f"{first.url}/v1/completions", json=PROMPT, timeout=10).status_code == 200
        asyncio.run(second_core.close())
    finally:
        first.stop()
