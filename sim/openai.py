"""The simulated worker's OpenAI-compatible API, shaped like vLLM's server (docs/openai.md):
`POST /v1/completions`, `POST /v1/chat/completions` (SSE when `stream`), `GET /v1/models`,
`POST /tokenize`, and vLLM's Prometheus gauge names for `/metrics` (`vllm_metric_lines`).

A request is tokenized with the model's tokenizer (`kvatlas worker --tokenizer DIR`) exactly as
vLLM does it (router_api/tokenization.py: a prompt gets the post-processor's BOS, a chat is its
rendered template with no tokens added; a `prompt` of token ids is taken as is), then served by
the engine like `/generate`: its prompt blocks enter the cache and go out as KV events. The reply
is paced to the simulated model's timeline. `return_token_ids: true` adds `prompt_token_ids`
(as vLLM does); `usage.prompt_tokens_details.cached_tokens` is what the request took from the cache
when it ran (vLLM's count at scheduling; `x-kvatlas-cached-tokens`: what the worker held on arrival).
A client that disconnects before the reply ends (a closed SSE stream, or a non-streamed request
whose client leaves) cancels the request, as `/generate` does: `Engine.cancel` gives its wait,
prefill interval and batch slot back on the timeline; counted as `outcome="cancelled"`.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import time
import uuid
from typing import Any, AsyncIterator, Callable

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from sim.engine import Engine, VirtualClock
from router_api.request_body import read_capped
from sim.httpbody import MAX_AHEAD_S, MAX_BODY_BYTES, MAX_OUTPUT_TOKENS, client_left_within
from sim.schedule import QueueFull

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()
_FILLER = " the cache holds key and value blocks"


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _err(status: int, message: str) -> Response:
    # vLLM's error shape
    body = {"error": {"message": message, "type": "BadRequestError" if status < 500 else "ServiceUnavailable",
                      "code": status}}
    return Response(_enc.encode(body), status_code=status, media_type="application/json")


def _max_tokens(body: dict[str, Any], key_order: tuple[str, ...]) -> int:
    for k in key_order:
        v = body.get(k)
        if v is not None:
            # The /generate bound: one request may not hold a batch slot for hours of simulated time.
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_OUTPUT_TOKENS:
                raise BadRequest(400, f"{k} must be an integer from 0 to {MAX_OUTPUT_TOKENS}")
            return v
    return 16


class PacedStream(StreamingResponse):
    """An SSE reply that calls `on_end` once it is over, however it ended: completed, ended short, cancelled
    by Starlette on the client's disconnect (possibly before the body began), or failed on a send."""

    def __init__(self, content: AsyncIterator[bytes], on_end: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self.on_end = on_end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()


class ArrivalClock:
    """The replay's clock as this worker sees it: the latest explicit arrival (`kvatlas_arrival_s`)
    plus the wall time since, at the worker's speed; the worker's own clock until one arrives. The
    load under vLLM's gauge names is read at this time, so a router polling it sees the queue of the
    replay's present, not of the worker's own clock (which started before the replay)."""

    __slots__ = ("clock", "last", "t_wall")

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.last: float | None = None
        self.t_wall = 0.0

    def saw(self, at: float) -> None:
        if self.last is None or at >= self.last:
            self.last = at
            self.t_wall = time.monotonic()

    def now(self) -> float:
        if self.last is None:
            return self.clock.now()
        return self.last + (time.monotonic() - self.t_wall) * self.clock.speed


class OpenAIFront:
    """Turns OpenAI request bodies into engine submissions and paced replies."""

    def __init__(self, engine: Engine, clock: VirtualClock, worker_id: str, model: str, tokenizer: Any,
                 max_model_len: int = 1 << 20) -> None:
        self.engine = engine
        self.clock = clock
        self.load_clock = ArrivalClock(clock)  # what /metrics reads the load at
        self.worker_id = worker_id
        self.model = model
        self.tokenizer = tokenizer  # router_api.tokenization.ChatTokenizer or None (token-id prompts only)
        self.max_model_len = max_model_len
        self._ids = itertools.count(1)
        self.counts = {"ok": 0, "bad": 0, "rejected": 0, "cancelled": 0}  # requests by outcome (/metrics)
        filler = tokenizer.encode_prompt(_FILLER, add_special_tokens=False) if tokenizer is not None else [1]
        self._filler = filler or [1]

    # -- tokenizing ------------------------------------------------------------------------------
    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise BadRequest(400, "this worker has no tokenizer (start it with --tokenizer DIR): "
                                  "send the prompt as token ids")
        return self.tokenizer

    def prompt_ids(self, body: dict[str, Any]) -> list[int]:
        from router_api.tokenization import TokenizerError

        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       and 0 <= t < 1 << 32 for t in prompt):
            return list(prompt)
        if not isinstance(prompt, str):
            raise BadRequest(400, "prompt must be a string or a list of token ids (one prompt per request)")
        add = body.get("add_special_tokens", True)
        try:
            return self._need_tokenizer().encode_prompt(prompt, add_special_tokens=bool(add))
        except TokenizerError as exc:
            raise BadRequest(400, str(exc)) from None

    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        from router_api.tokenization import TokenizerError

        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest(400, "messages must be a non-empty list")
        try:
            return self._need_tokenizer().encode_chat(
                msgs, add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                add_special_tokens=bool(body.get("add_special_tokens", False)),
                template_kwargs=body.get("chat_template_kwargs") or None)
        except TokenizerError as exc:
            raise BadRequest(400, str(exc)) from None

    def output(self, n: int) -> tuple[list[int], list[str]]:
        """n generated token ids and their text pieces (a fixed filler: the model is simulated)."""
        ids = [self._filler[i % len(self._filler)] for i in range(n)]
        if self.tokenizer is None:
            return ids, [" tok"] * n
        return ids, [self.tokenizer.decode([t]) for t in ids]

    # -- serving ---------------------------------------------------------------------------------
    async def run(self, ids: list[int], max_tokens: int, arrival_s: float | None = None) -> tuple[Any, float]:
        """Submit to the engine (at `arrival_s` on its virtual clock; None: now); returns (Served, wall
        monotonic time of arrival)."""
        if not ids:
            raise BadRequest(400, "the prompt is empty")
        if len(ids) + max_tokens > self.max_model_len:
            raise BadRequest(400, f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds "
                                  f"max_model_len {self.max_model_len}")
        t_wall = time.monotonic()
        try:
            at = self.clock.now() if arrival_s is None else arrival_s
            served = await asyncio.wrap_future(self.engine.submit(ids, max_tokens, at))
        except QueueFull as exc:
            raise BadRequest(503, f"queue full: {exc}") from None
        return served, t_wall

    async def paced(self, request: Request, t_wall: float, virtual_s: float) -> bool:
        """Wait until `virtual_s` into the request's simulated timeline (pacing, not a synchronisation);
        False when the client disconnected first."""
        return not await client_left_within(request, t_wall + virtual_s / self.clock.speed - time.monotonic())

    def cancelled(self, served: Any) -> None:
        self.engine.cancel(served, self.clock.now())
        self.counts["cancelled"] += 1

    def _stream_ended(self, served: Any, done: asyncio.Event) -> None:
        if done.is_set():
            self.counts["ok"] += 1
        else:
            self.cancelled(served)

    def usage(self, ids: list[int], n_out: int, served: Any) -> dict[str, Any]:
        return {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out,
                # as vLLM counts it: the prompt tokens the request took from the cache when it was
                # scheduled (a request queued behind the one storing its prefix gets that prefix)
                "prompt_tokens_details": {"cached_tokens": served.tokens.cached}}

    def arrival_of(self, body: dict[str, Any]) -> float | None:
        """`kvatlas_arrival_s` (an extension field): the request's arrival on the simulated clock, as
        `/generate`'s `arrival_s` (a trace replay sets it, so virtual times do not depend on the
        machine's load); at most MAX_AHEAD_S past the worker's clock."""
        at = body.get("kvatlas_arrival_s")
        if at is None:
            return None
        if type(at) not in (int, float) or not 0 <= at <= self.clock.now() + MAX_AHEAD_S:
            raise BadRequest(400, f"kvatlas_arrival_s must be a number within [0, now + {MAX_AHEAD_S:g}]")
        self.load_clock.saw(float(at))
        return float(at)

    async def handle(self, request: Request, body: dict[str, Any], chat: bool) -> Response:
        ids = self.chat_ids(body) if chat else self.prompt_ids(body)
        n = _max_tokens(body, ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",))
        model = body.get("model") or self.model
        served, t_wall = await self.run(ids, n, self.arrival_of(body))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        created = int(time.time())
        out_ids, pieces = self.output(n)
        extra = {"prompt_token_ids": ids} if body.get("return_token_ids") else {}
        t = served.tokens
        headers = {"x-kvatlas-worker": self.worker_id, "x-kvatlas-cached-tokens": str(served.arrival_cached),
                   # the simulated timeline (virtual seconds) and where the prompt came from: what a
                   # trace replay through the router records (router/replay.py)
                   "x-kvatlas-served": f"gpu={t.gpu},host={t.host},disk={t.disk},shared={t.shared},computed={t.computed}",
                   "x-kvatlas-ttft-s": f"{served.ttft_s:.6f}", "x-kvatlas-queue-s": f"{served.queue_s:.6f}",
                   "x-kvatlas-e2e-s": f"{served.e2e_s:.6f}"}
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            done = asyncio.Event()
            gen = self._stream(request, done, rid, created, model, chat, ids, pieces, served, t_wall,
                               bool(opts.get("include_usage")), extra)
            return PacedStream(gen, functools.partial(self._stream_ended, served, done), media_type="text/event-stream",
                           headers=headers)
        if not await self.paced(request, t_wall, served.e2e_s):
            self.cancelled(served)
            return Response(status_code=499)  # never read: the client is gone
        self.counts["ok"] += 1
        text = "".join(pieces)
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": "length", "stop_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        if extra:
            choice["token_ids"] = out_ids
        res = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
               "model": model, "choices": [choice], "usage": self.usage(ids, n, served), **extra}
        return Response(_enc.encode(res), media_type="application/json", headers=headers)

    async def _stream(self, request: Request, done: asyncio.Event, rid: str, created: int, model: str, chat: bool,
                      ids: list[int], pieces: list[str], served: Any, t_wall: float, include_usage: bool,
                      extra: dict[str, Any]) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None = None, first: bool = False, ids_too: bool = False) -> bytes:
            if chat:
                d: dict[str, Any] = {} if delta is None else {"content": delta}
                if first:
                    d = {"role": "assistant", "content": ""}
                choice: dict[str, Any] = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            c = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if ids_too:
                c.update(extra)
            return b"data: " + _enc.encode(c) + b"\n\n"

        # A client that goes is seen here while pacing (the stream then ends short) or by Starlette,
        # which cancels the stream; `PacedStream` cancels the request on the timeline unless [DONE] went out.
        if not await self.paced(request, t_wall, served.ttft_s):
            return
        if chat:
            yield chunk(None, first=True, ids_too=bool(extra))
        n = len(pieces)
        step = (served.e2e_s - served.ttft_s) / max(1, n - 1)
        for i, piece in enumerate(pieces):
            if not await self.paced(request, t_wall, served.ttft_s + i * step):
                return
            last = i == n - 1
            yield chunk(piece, "length" if last else None, ids_too=not chat and i == 0 and bool(extra))
        if n == 0:
            yield chunk("", "length", ids_too=not chat and bool(extra))
        if include_usage:
            u = {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                 "usage": self.usage(ids, n, served)}
            yield b"data: " + _enc.encode(u) + b"\n\n"
        yield b"data: [DONE]\n\n"
        done.set()

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = self.chat_ids(body) if "messages" in body else self.prompt_ids(body)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}


def vllm_metric_lines(engine: Engine, clock: VirtualClock | ArrivalClock, model: str) -> list[str]:
    """The worker's load under vLLM's gauge names (what `kvatlas router` polls on a real vLLM)."""
    _, queued, running, *_ = engine.load(clock.now())
    free, total = engine.pages()
    usage = 1.0 - free["gpu"] / total["gpu"] if total.get("gpu") else 0.0
    label = '{model_name="%s"}' % model.replace("\\", "\\\\").replace('"', '\\"')
    out = []
    for name, kind, value in (("vllm:num_requests_running", "gauge", running),
                              ("vllm:num_requests_waiting", "gauge", queued),
                              ("vllm:gpu_cache_usage_perc", "gauge", usage),
                              ("vllm:kv_cache_usage_perc", "gauge", usage)):
        out += [f"# TYPE {name} {kind}", f"{name}{label} {value}"]
    return out


def mount_openai(app: FastAPI, front: OpenAIFront) -> None:
    """Adds the OpenAI routes to the worker's app."""

    async def body_of(request: Request) -> dict[str, Any]:
        raw = await read_capped(request, MAX_BODY_BYTES)
        if raw is None:
            raise BadRequest(413, f"body exceeds the {MAX_BODY_BYTES}-byte limit")
        try:
            body = _dec.decode(raw)
        except msgspec.DecodeError as exc:
            raise BadRequest(400, f"malformed JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest(400, "the body must be a JSON object")
        return body

    async def serve(request: Request, chat: bool) -> Response:
        try:
            return await front.handle(request, await body_of(request), chat)
        except BadRequest as exc:
            front.counts["rejected" if exc.status == 503 else "bad"] += 1
            return _err(exc.status, str(exc))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        try:
            return Response(_enc.encode(front.tokenize(await body_of(request))), media_type="application/json")
        except BadRequest as exc:
            return _err(exc.status, str(exc))

    @app.get("/v1/models")
    async def models() -> Response:
        data = {"object": "list", "data": [{"id": front.model, "object": "model", "created": 0,
                                            "owned_by": "kvatlas-sim", "max_model_len": front.max_model_len}]}
        return Response(_enc.encode(data), media_type="application/json")
