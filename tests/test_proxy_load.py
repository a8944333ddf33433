"""Worker load for the OpenAI router (router/proxy/load.py): vLLM's and SGLang's metric names,
data-parallel series summed, junk skipped; workers whose metrics cannot be read are marked down with
a reason (refused, 404, empty bodies) instead of crashing or waiting; the sim router names the fix
when pointed at a server shaped like vLLM."""
from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from fastapi import FastAPI, Response

from router.proxy.load import LoadPoller, parse_load
from router.simworker import fetch_sim
from support.net import ThreadedServer, free_port

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:prompt_tokens_total{model_name="m"} 12345.0
"""


def test_parse_vllm_sglang_and_junk() -> None:
    ld = parse_load(VLLM)
    assert (ld.running, ld.waiting, ld.kv_usage, ld.engine) == (5.0, 7.0, 0.25, "vllm")
    old = parse_load('vllm:gpu_cache_usage_perc{model_name="m"} 0.5\nvllm:num_requests_waiting 1\n')
    assert (old.kv_usage, old.waiting, old.running) == (0.5, 1.0, None)
    sg = parse_load('sglang:num_running_reqs{model_name="m",tp_rank="0"} 4\nsglang:num_queue_reqs{x="}"} 9\n'
                    "sglang:token_usage 0.75\n")
    assert (sg.running, sg.waiting, sg.kv_usage, sg.engine) == (4.0, 9.0, 0.75, "sglang")
    junk = parse_load("vllm:num_requests_running{a=\"1\"} notanumber\nvllm:num_requests_waiting\n\x00\n{}\n"
                      "vllm:num_requests_waiting NaN\nvllm:num_requests_running 1 1700000000\n")
    assert (junk.running, junk.waiting) == (1.0, None)
    assert parse_load("").engine == "unknown"


class Server:
    """A real HTTP server shaped like a vLLM engine (`mode` "vllm"), or one whose /metrics 404s and
    whose /health is an empty 200 ("bare")."""

    def __init__(self, mode: str) -> None:
        app = FastAPI()

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(VLLM, media_type="text/plain") if mode == "vllm" else Response(status_code=404)

        @app.get("/health")
        async def health() -> Response:
            return Response(b"", status_code=200)

        self._http = ThreadedServer(app)
        self.url = self._http.url

    def stop(self) -> None:
        self._http.stop()


@pytest.fixture
def servers():
    s = {"vllm": Server("vllm"), "bare": Server("bare")}
    yield s
    for x in s.values():
        x.stop()


def test_poller_marks_unreadable_workers_down(servers, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvatlas.router")
    workers = {"good": servers["vllm"].url, "bare": servers["bare"].url, "gone": f"http://127.0.0.1:{free_port()}"}

    async def go() -> LoadPoller:
        async with httpx.AsyncClient() as client:
            p = LoadPoller(workers, client, interval_s=60)
            await p.poll_all()
            await p.poll_all()  # a second failing poll: no second log line
            return p

    p = asyncio.run(go())
    assert p.up() == ["good"]
    assert p.states["good"].load.waiting == 7.0
    assert "HTTP 404" in p.states["bare"].reason
    assert "unreachable" in p.states["gone"].reason
    downs = [r.getMessage() for r in caplog.records if "event=worker_down" in r.getMessage()]
    assert len(downs) == 2 and any("worker=gone" in d for d in downs)
    p.mark_down("good", "forward failed")
    assert p.up() == []


def test_sim_router_names_the_fix_for_a_vllm_shaped_worker(servers) -> None:
    async def go() -> None:
        async with httpx.AsyncClient() as client:
            await fetch_sim(client, servers["bare"].url, deadline_s=30)

    with pytest.raises(ValueError, match="--api openai"):
        asyncio.run(go())
