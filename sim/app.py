"""The worker's HTTP API (FastAPI): `POST /generate`, `GET /load`, `GET /health`, `GET /metrics`,
and the OpenAI-compatible routes of `sim.openai` (`/v1/completions`, `/v1/chat/completions`, ...).

Bodies are msgspec-decoded (`sim.api`); bad bodies get 400/422 with a message. A request's
response headers go out when the engine has queued it (its queue is served in order; a streaming
engine's headers come at that point too; routers use them for causal forwarding, docs/CONTRACTS.md
"Pending routes"); its body is held until its
simulated completion on the wall clock (virtual e2e / speed), so a router's in-flight counts mean
what they would with a real engine (docs/end-to-end.md).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request, Response

from sim.engine import Engine, VirtualClock
from router_api.request_body import read_capped
from sim.httpbody import MAX_AHEAD_S, MAX_BODY_BYTES, MAX_OUTPUT_TOKENS, client_left_within
from sim.schedule import QueueFull
from sim.api import GenerateRequest, GenerateResponse, LoadResponse, WorkerHealth

_JSON = "application/json"
# A request must arrive whole (headers and body) this long after its first byte; at most this many
# connections are open at once (beyond: 503 and closed). Slow-header clients cannot hold the worker.
WORKER_REQUEST_TIMEOUT_S = 10.0
WORKER_MAX_CONNECTIONS = 1024


class HttpLimits:
    """The worker's HTTP limits and their rejections by reason (`/metrics`)."""

    __slots__ = ("request_timeout_s", "max_connections", "rejects")

    def __init__(self, request_timeout_s: float = WORKER_REQUEST_TIMEOUT_S,
                 max_connections: int = WORKER_MAX_CONNECTIONS) -> None:
        self.request_timeout_s = request_timeout_s
        self.max_connections = max_connections
        self.rejects: dict[str, int] = {}

    def count(self, reason: str) -> None:
        self.rejects[reason] = self.rejects.get(reason, 0) + 1

    def protocol(self) -> type:
        """uvicorn's `http` protocol with these limits (router_api/fasthttp.py's guard, no fast path)."""
        from router_api.fasthttp import protocol_class, supported

        if not supported():
            raise RuntimeError("this uvicorn lacks the hooks the worker's request deadline needs")
        return protocol_class(False, self.request_timeout_s, self.max_connections, on_reject=self.count)
_dec = msgspec.json.Decoder(GenerateRequest)
_enc = msgspec.json.Encoder()


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_enc.encode(obj), status_code=status, media_type=_JSON)


def _error(status: int, message: str) -> Response:
    return _json({"error": message}, status)


def create_worker_app(engine: Engine, health: WorkerHealth, clock: VirtualClock, tokenizer: Any = None,
                      limits: HttpLimits | None = None, events_seq: Callable[[], int | None] | None = None) -> FastAPI:
    """`tokenizer`: the model's router_api.tokenization.ChatTokenizer for the OpenAI routes' text
    (sim/openai.py); without one they take token-id prompts only. `events_seq`: sends the events
    recorded so far and returns the last batch's seq (blocking; `GET /load?settle=true`)."""
    from sim.openai import OpenAIFront, PacedStream, mount_openai, vllm_metric_lines

    app = FastAPI(title=f"kvatlas worker {health.worker_id}", docs_url=None, redoc_url=None)
    front = OpenAIFront(engine, clock, health.worker_id, health.model, tokenizer)
    mount_openai(app, front)
    wid = health.worker_id
    app.state.limits = limits = limits if limits is not None else HttpLimits()
    counters = {"generate_ok": 0, "generate_bad": 0, "generate_rejected": 0, "generate_cancelled": 0}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        t_wall = time.monotonic()
        body = await read_capped(request, MAX_BODY_BYTES)
        if body is None:
            counters["generate_bad"] += 1
            return _error(413, f"body exceeds the {MAX_BODY_BYTES}-byte limit")
        try:
            req = _dec.decode(body)
        except msgspec.ValidationError as exc:
            counters["generate_bad"] += 1
            return _error(422, f"invalid request: {exc}")
        except msgspec.DecodeError as exc:
            counters["generate_bad"] += 1
            return _error(400, f"malformed JSON: {exc}")
        if not req.token_ids:
            counters["generate_bad"] += 1
            return _error(422, "token_ids must not be empty")
        if req.max_tokens > MAX_OUTPUT_TOKENS:
            counters["generate_bad"] += 1
            return _error(422, f"max_tokens {req.max_tokens} exceeds this worker's limit {MAX_OUTPUT_TOKENS}")
        now = clock.now()
        if req.arrival_s is not None and not req.arrival_s <= now + MAX_AHEAD_S:  # (also inf and nan)
            counters["generate_bad"] += 1
            return _error(422, f"arrival_s {req.arrival_s} is more than {MAX_AHEAD_S:g}s past the worker's clock "
                               f"({now:.3f})")
        arrival = now if req.arrival_s is None else req.arrival_s
        if engine.full(arrival):
            counters["generate_rejected"] += 1
            return _error(503, f"queue full: {engine.sim.max_queue} requests already waiting")
        # The engine serves its queue in order: from here on this request is admitted, and the headers
        # go out now, as a streaming engine's do once it queued a request (a router forwards the
        # requests that count on this one's blocks when it sees them: docs/CONTRACTS.md "Causal
        # forwarding"). The body follows at the simulated completion (a pacing wait, not a sync).
        fut = engine.submit(req.token_ids, req.max_tokens, arrival)
        state: dict[str, Any] = {"served": None, "done": False}

        async def stream() -> AsyncIterator[bytes]:
            try:
                served = await asyncio.wrap_future(fut)
            except QueueFull as exc:  # filled up between the check and its turn: the status is sent
                counters["generate_rejected"] += 1
                state["done"] = True
                yield _enc.encode({"error": f"queue full: {exc}"})
                return
            state["served"] = served
            answer = _enc.encode(GenerateResponse(
                worker_id=wid, request_id=req.request_id, input_tokens=len(req.token_ids),
                output_tokens=req.max_tokens, arrival_cached=served.arrival_cached, served=served.tokens,
                queue_s=served.queue_s, load_s=served.load_s, prefill_s=served.prefill_s,
                ttft_s=served.ttft_s, e2e_s=served.e2e_s))
            # A client that disconnects first cancels it, freeing its batch slot on the timeline.
            if await client_left_within(request, t_wall + served.e2e_s / clock.speed - time.monotonic()):
                return
            state["done"] = True
            counters["generate_ok"] += 1
            yield answer

        def cancel(f: Any) -> None:
            if not f.cancelled() and f.exception() is None:
                engine.cancel(f.result(), clock.now())

        def ended() -> None:
            if state["done"]:
                return
            counters["generate_cancelled"] += 1
            if state["served"] is not None:
                engine.cancel(state["served"], clock.now())
            elif not fut.cancel():  # the engine has it already: free its slot once it is placed
                fut.add_done_callback(cancel)

        return PacedStream(stream(), ended, media_type=_JSON)

    @app.get("/load")
    async def load(at: float | None = None, settle: bool = False) -> Response:
        """The load at virtual time `at`. `settle`: first every request handed to the engine before
        this call is served, its copies landed and its events published (`Engine.barrier`), and the
        answer names the last event batch's seq: a router deciding in lockstep (docs/end-to-end.md,
        "Lockstep") reads the load and, once the indexer applied that seq, the index as they left them."""
        seq = None
        if settle:
            await asyncio.wrap_future(engine.barrier())
            if events_seq is not None:
                seq = await asyncio.to_thread(events_seq)
        t, queued, running, backlog, free_at = engine.load(at)
        free, total = engine.pages()
        return _json(LoadResponse(worker_id=wid, at_s=t, queued=queued, running=running,
                                  backlog_s=backlog, free_pages=free, total_pages=total, free_at_s=free_at,
                                  events_seq=seq))

    @app.get("/health")
    async def health_() -> Response:
        return _json(health)

    @app.get("/metrics")
    async def metrics() -> Response:
        free, total = engine.pages()
        lines = [f'kvatlas_worker_requests_total{{worker="{wid}",outcome="{k.removeprefix("generate_")}"}} {v}'
                 for k, v in counters.items()]
        lines += [f'kvatlas_worker_engine_total{{worker="{wid}",what="{k}"}} {v}' for k, v in engine.counts.items()]
        lines += [f'kvatlas_worker_free_pages{{worker="{wid}",tier="{k}"}} {v}' for k, v in free.items()]
        lines += [f'kvatlas_worker_pages{{worker="{wid}",tier="{k}"}} {v}' for k, v in total.items()]
        lines += [f'kvatlas_worker_cache_total{{worker="{wid}",what="{k}"}} {v}'
                  for k, v in sorted(engine.cache.stats.items())]
        lines += [f'kvatlas_worker_openai_requests_total{{worker="{wid}",outcome="{k}"}} {v}'
                  for k, v in front.counts.items()]
        lines += [f'kvatlas_worker_http_rejects_total{{worker="{wid}",reason="{k}"}} {v}'
                  for k, v in sorted(limits.rejects.items())]
        lines += vllm_metric_lines(engine, front.load_clock, health.model)
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app
