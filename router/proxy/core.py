"""The OpenAI proxy's routing shell (docs/openai.md): tokenize the request as the engine will, let
the indexer score, choose and record the in-flight route in one call (`POST /routes/decide`,
router_api/decide.py; the policy's code is router/decision.py either way), wait for the routes the
prediction counted to be admitted (causal forwarding), forward, and report the admission and the
release (both queued: they ride on this router's next decision, or go out in a batch) however the
response ended. A connection failure or a missed first-byte deadline before the
first byte retries another worker.

Nothing here fails a request the engines would serve: without a tokenizer, with messages the
template refuses, or with the indexer unreachable the request is routed on load alone (`unscored`
in `x-kvatlas-route`, the router's /health `degraded`); only "no worker is up" answers 503.
"""
from __future__ import annotations

import array
import asyncio
import itertools
import logging
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

import httpx
import msgspec
import numpy as np

from router.decision import block_keys, choose, worker_view
from router.policies import Decision, Policy, ScoreRow, make_policy
from router.proxy.indexer import IndexerClient, Unavailable
from router.proxy.limits import CLIENT_KEEPALIVE_S
from router.proxy.load import LoadPoller
from router.proxy.lockstep import Lockstep, View
from router.proxy.rawhttp import RawClient, RawResponse, UpstreamError, within
from router.proxy.stats import TAIL_BYTES, Accuracy, Histogram, served_cached
from router.proxy.tally import Tally
from router_api.decide import Candidate, DecideRequest
from router_api.tokenization import ChatTokenizer, TokenizerError
from schemas.api import MAX_QUERY_TOKENS
from schemas.costmodel import SimModel

log = logging.getLogger("kvatlas.router")
decisions = logging.getLogger("kvatlas.router.decisions")
_enc = msgspec.json.Encoder()
# Request headers not forwarded (hop-by-hop, or recomputed by the client library).
_DROP_REQ = frozenset({b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"upgrade",
                       b"te", b"trailer", b"proxy-authorization", b"proxy-connection", b"accept-encoding"})
_DROP_RESP = frozenset({"connection", "keep-alive", "transfer-encoding", "upgrade", "te", "trailer", "date", "server",
                        "content-length"})
# Bodies up to this size are tokenized on the loop (a thread hop costs more than a short chat's
# encoding, and a shared system prompt comes from the piece cache); larger ones in a thread.
INLINE_TOKENIZE_BYTES = 16 * 1024


def _u32(ids: list[int]) -> np.ndarray:
    """`np.asarray(ids, dtype="<u4")` at about a third of its cost (array.array reads a list of ints
    in C; numpy then wraps its buffer without a copy). Ids are below 2**32 (tokenizer ids, or a
    prompt's validated ids)."""
    return np.frombuffer(array.array("I", ids), dtype="=u4").astype("<u4", copy=False)


assert array.array("I").itemsize == 4


class NoWorker(Exception):
    """No worker is up (or every one failed before its first byte)."""


class BadRequest(ValueError):
    """A request the engines would refuse too (answered 400, not routed)."""


class Truncated(Exception):
    """The engine's answer broke off: the client's connection is cut, not ended cleanly."""


class Route:
    """One routed request: the decision and what was scored."""

    __slots__ = ("request_id", "worker_id", "tokens", "cached_tokens", "policy", "tried", "reserved", "dp_rank",
                 "scored", "unscored_reason", "model", "after", "decide_s", "pending_tokens", "view")

    def __init__(self, request_id: str, tokens: np.ndarray | None, policy: str, model: str) -> None:
        self.request_id = request_id
        self.worker_id = ""
        self.dp_rank = 0
        self.tokens = tokens
        self.cached_tokens: int | None = None
        self.policy = policy
        self.model = model
        self.tried: list[str] = []
        self.reserved = False          # the indexer holds this route in flight (released at the end)
        self.scored = False
        self.unscored_reason = ""
        self.after: list[str] = []     # routes to wait for (causal forwarding)
        self.decide_s = 0.0
        self.pending_tokens: int | None = None  # of the prediction: in-flight routes' blocks
        self.view: View | None = None  # lockstep: what the decision read (router/proxy/lockstep.py)

    def header(self) -> str:
        predicted = ("unscored" if not self.scored else
                     "" if self.cached_tokens is None else str(self.cached_tokens))
        parts = [f"worker={self.worker_id}", f"policy={self.policy}",
                 f"prompt_tokens={'' if self.tokens is None else len(self.tokens)}",
                 f"predicted_cached_tokens={predicted}", f"retries={max(0, len(self.tried) - 1)}"]
        if self.scored and self.pending_tokens:
            parts.append(f"predicted_pending_tokens={self.pending_tokens}")
        if not self.scored and self.unscored_reason:
            parts.append(f"unscored={self.unscored_reason}")
        return "; ".join(parts)


class _OnceLog:
    """A warning per key at most every `every_s` seconds (bad requests or a down indexer must not flood the log)."""

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self._next: dict[str, float] = {}

    def warning(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now >= self._next.get(key, 0.0):
            self._next[key] = now + self.every_s
            log.warning(msg, *args)


class ProxyCore:
    def __init__(self, workers: dict[str, str], *, indexer: str | None, model: str, tokenizer: ChatTokenizer | None,
                 policy: str, sim: SimModel | None = None, block_size: int = 16, metrics_interval_s: float = 1.0,
                 forward_token_ids: bool = False, report_routes: bool = True, seed: int = 0,
                 connect_timeout_s: float = 2.0, read_timeout_s: float = 600.0, first_byte_timeout_s: float = 300.0,
                 indexer_token: str | None = None, admission_timeout_s: float = 2.0,
                 max_tokenize_bytes: int = 4 * 1024 * 1024, tokenize_timeout_s: float = 10.0,
                 tokenize_threads: int = 2, decision_log_rate: float = 0.0,
                 worker_models: dict[str, str] | None = None, lockstep: bool = False) -> None:
        self.workers = dict(workers)
        self.worker_models = dict(worker_models or {})  # worker -> the model it serves (absent: any)
        self.model = model
        self.tokenizer = tokenizer
        self.policy_name = policy
        self.sim = sim or SimModel()
        self.block_size = block_size
        self.forward_token_ids = forward_token_ids
        self.report_routes = report_routes
        self.seed = seed
        self.first_byte_timeout_s = first_byte_timeout_s
        self.admission_timeout_s = admission_timeout_s
        self.max_tokenize_bytes = max_tokenize_bytes
        self.tokenize_timeout_s = tokenize_timeout_s
        self.decision_log_rate = decision_log_rate
        make_policy(policy, list(workers) or ["-"], self.sim, seed)  # fail at start on a bad name
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s),
                                        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256,
                                                            keepalive_expiry=CLIENT_KEEPALIVE_S))
        # forwards to plain-http engines go through the pooled raw client (docs/openai.md, "Cost per request")
        self.raw = RawClient(max_idle=256, keepalive_s=CLIENT_KEEPALIVE_S, connect_timeout_s=connect_timeout_s)
        self.indexer = IndexerClient(indexer, self.client, indexer_token) if indexer else None
        self.poller = LoadPoller(self.workers, self.client, interval_s=metrics_interval_s)
        self._policies: dict[tuple[str, ...], Policy] = {}
        self.inflight = {w: 0 for w in workers}
        self.counts = {"requests": 0, "routed": 0, "retries": 0, "no_worker": 0, "unscored": 0, "upstream_errors": 0,
                       "first_byte_timeouts": 0, "client_gone": 0, "bad_request": 0, "truncated": 0,
                       "admission_waits": 0, "admission_timeouts": 0}
        self.routed_to = {w: 0 for w in workers}
        # connections the HTTP front refused, by reason (request_timeout, connection_limit: a fixed set)
        self.http_rejects: dict[str, int] = {}
        self.decision_latency = Histogram()
        self.indexer_latency = Histogram()
        self.accuracy = Accuracy()
        self.tally = Tally()  # per model and worker, for the router page (router/proxy/page.py)
        self._warn = _OnceLog()
        self._avg_tokens = 1024.0
        self._tok_pool = ThreadPoolExecutor(max(1, tokenize_threads), thread_name_prefix="kvatlas-tokenize")
        self._tok_slots = asyncio.Semaphore(max(1, tokenize_threads))
        self._rng = random.Random(seed)
        # request ids: this process's random 64 bits, then a counter (unique across router replicas
        # sharing one indexer, without a uuid4 and its urandom call per request)
        self._id_prefix = f"kvatlas-{os.urandom(8).hex()}"
        self._id_seq = itertools.count()
        self.extra_health: dict[str, Any] = {}  # added to /health (a trace replay's progress)
        # the simulated clock's view of load and in-flight (kvatlas demo; router/proxy/lockstep.py)
        self.lockstep = Lockstep(self.workers, self.client, indexer,
                                 {"Authorization": f"Bearer {indexer_token}"} if indexer_token else None
                                 ) if lockstep else None


    def http_rejected(self, reason: str) -> None:
        """The HTTP front refused a connection (a head past its deadline, over the connection cap)."""
        self.http_rejects[reason] = self.http_rejects.get(reason, 0) + 1
    def add_worker(self, worker_id: str, url: str, model: str | None = None) -> None:
        """A worker learned at run time (the indexer's registry): polled, then routed to once up."""
        self.workers[worker_id] = url
        if model:
            self.worker_models[worker_id] = model
        self.inflight.setdefault(worker_id, 0)
        self.routed_to.setdefault(worker_id, 0)
        self.poller.add(worker_id, url)

    async def start(self) -> None:
        await self.poller.poll_all()  # a first reading before serving: down workers are known at once
        self.poller.start()
        if self.indexer is not None:
            self.indexer.start()

    async def close(self) -> None:
        await self.poller.close()
        if self.indexer is not None:
            await self.indexer.close()
        self.raw.close()
        await self.client.aclose()
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    def health(self) -> tuple[str, list[str]]:
        """ok | degraded (with why) | no_worker."""
        up = self.poller.up()
        if not up:
            return "no_worker", ["no worker is up"]
        why: list[str] = []
        if self.indexer is None:
            why.append("no indexer: routing on load only")
        elif self.indexer.state != "ok":
            why.append(f"indexer {self.indexer.url}: {self.indexer.state}")
        if self.tokenizer is None:
            why.append("no tokenizer: text requests are routed on load only")
        return ("degraded" if why else "ok"), why

    # -- tokens ----------------------------------------------------------------------------------
    def tokens_of(self, body: dict[str, Any], chat: bool) -> list[int] | None:
        """The ids the engine will make of this request, or None when they cannot be known here.
        Raises BadRequest for a request the engine refuses too."""
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise BadRequest("chat_template_kwargs must be an object")
        if not chat:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
                prompt = prompt[0]
            if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < 1 << 32 for t in prompt):
                return list(prompt)
        tok = self.tokenizer
        if tok is None:
            self._warn.warning("no_tokenizer", "event=unscored reason=no_tokenizer detail=text requests are routed "
                               "on load only; start the router with --tokenizer DIR")
            return None
        try:
            if chat:
                return tok.encode_chat(body.get("messages") or [],
                                       add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                                       add_special_tokens=bool(body.get("add_special_tokens", False)),
                                       tools=body.get("tools"), template_kwargs=kwargs or None)
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                return None
            return tok.encode_prompt(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
        except (TokenizerError, RecursionError) as exc:
            self._warn.warning("bad_text", "event=unscored reason=tokenize_failed error=%s", exc)
            return None

    async def tokenize(self, body: dict[str, Any], chat: bool, size: int) -> tuple[list[int] | None, str]:
        """`tokens_of` within bounds: small bodies on the loop, larger ones in a bounded thread pool
        with a deadline; beyond `max_tokenize_bytes` not at all. (ids, why unscored)."""
        if size <= INLINE_TOKENIZE_BYTES or (not chat and isinstance(body.get("prompt"), list)):
            ids = self.tokens_of(body, chat)
        elif size > self.max_tokenize_bytes:
            return None, "too_large_to_tokenize"
        else:
            loop = asyncio.get_running_loop()
            try:
                async with self._tok_slots:
                    ids = await asyncio.wait_for(loop.run_in_executor(self._tok_pool, self.tokens_of, body, chat),
                                                 self.tokenize_timeout_s)
            except asyncio.TimeoutError:
                return None, "tokenize_timeout"
        if ids is None:
            return None, "no_tokens"
        if len(ids) > MAX_QUERY_TOKENS:
            return None, "too_many_tokens"
        return ids, ""

    # -- deciding --------------------------------------------------------------------------------
    def _policy(self, up: list[str]) -> Policy:
        key = tuple(up)
        p = self._policies.get(key)
        if p is None:
            if len(self._policies) > 64:
                self._policies.clear()
            p = self._policies[key] = make_policy(self.policy_name, up, self.sim, self.seed)
        return p

    def candidates(self, model: str, exclude: list[str]) -> list[str]:
        up = [w for w in self.poller.up() if w not in exclude]
        if self.worker_models:
            up = [w for w in up if self.worker_models.get(w, model) == model]
        if not up:
            raise NoWorker("no worker is up: " + "; ".join(
                f"{w}: {st.reason if w not in exclude else 'failed before its first byte'}"
                for w, st in self.poller.states.items()))
        return up

    def backlog(self, up: list[str]) -> dict[str, float]:
        per_request = self.sim.prefill_s(int(self._avg_tokens))
        return {w: (self.poller.states[w].load.waiting or 0.0) * per_request for w in up}

    def decide(self, tokens: np.ndarray | None, scores: dict[str, ScoreRow] | None, up: list[str],
               view: View | None = None) -> Decision:
        """The local decision (no indexer call, or its /score rows): router/decision.py's."""
        pol = self._policy(up)
        keys: list[bytes] = []
        if pol.name == "approximate" and tokens is not None:
            keys = block_keys(tokens, self.block_size)
        if view is not None:
            return choose(pol, 0 if tokens is None else len(tokens), self.block_size, scores, view.backlog,
                          view.inflight, keys)
        return choose(pol, 0 if tokens is None else len(tokens), self.block_size, scores, self.backlog(up),
                      self.inflight, keys)

    def model_of(self, body: dict[str, Any]) -> str:
        """The indexer's model namespace of a request: its `model` when this router serves several."""
        m = body.get("model")
        return m if isinstance(m, str) and m in self.worker_models.values() else self.model

    async def route(self, body: dict[str, Any], chat: bool, size: int = 0) -> Route:
        t0 = time.perf_counter()
        ids, why = await self.tokenize(body, chat, size)
        tokens = None if ids is None else _u32(ids)
        model = self.model_of(body)
        # unique across router replicas sharing one indexer (its in-flight routes are keyed by this id)
        route = Route(f"{self._id_prefix}{next(self._id_seq):016x}", tokens, self.policy_name, model)
        route.unscored_reason = why
        up = self.candidates(model, [])
        if self.lockstep is not None:
            route.view = await self.lockstep.view(body, up)
        if tokens is not None:
            self._avg_tokens = 0.9 * self._avg_tokens + 0.1 * len(tokens)
            if self.indexer is None:
                route.unscored_reason = "no_indexer"
            else:
                await self._decide_at_indexer(route, body, up)
        if not route.worker_id:
            d = self.decide(tokens, None, up, route.view)
            route.worker_id = d.worker_id
            route.cached_tokens = d.predicted_cached if route.scored else None
        if not route.scored:
            self.counts["unscored"] += 1
        route.decide_s = time.perf_counter() - t0
        self.decision_latency.observe(route.decide_s)
        if self.decision_log_rate > 0 and self._rng.random() < self.decision_log_rate:
            decisions.info("event=decision request=%s model=%s worker=%s policy=%s prompt_tokens=%s predicted=%s "
                           "scored=%s reserved=%s after=%d decide_ms=%.3f", route.request_id, model, route.worker_id,
                           route.policy, "" if tokens is None else len(tokens), route.cached_tokens,
                           route.scored, route.reserved, len(route.after), route.decide_s * 1e3)
            self.tally.sample(route)
        return route

    async def _decide_at_indexer(self, route: Route, body: dict[str, Any], up: list[str]) -> None:
        """One round trip: the indexer scores, chooses (or records this router's own choice, for a
        policy that does not read the index) and reserves. If it cannot, its /score rows (an indexer
        without the endpoint) or nothing (unreachable) feed the local decision."""
        assert self.indexer is not None and route.tokens is not None
        pol = self._policy(up)
        view = route.view
        local = None if pol.uses_index else self.decide(route.tokens, None, up, view)
        back = self.backlog(up) if view is None else view.backlog
        inflight = self.inflight if view is None else view.inflight
        req = DecideRequest(route.request_id, [Candidate(w, back[w], inflight.get(w, 0)) for w in up],
                            route.model, tokens=route.tokens.tobytes(),
                            lora_name=body.get("lora_name") if isinstance(body.get("lora_name"), str) else None,
                            cache_salt=body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None,
                            policy=self.policy_name, sim=self.sim, choice=None if local is None else local.worker_id,
                            admits=self.admission_timeout_s > 0 and view is None,
                            reserve=self.report_routes and view is None)
        t0 = time.perf_counter()
        try:
            ans = await self.indexer.decide(req)
        except Unavailable as exc:
            self.indexer_latency.observe(time.perf_counter() - t0)
            route.unscored_reason = "indexer_" + str(exc).split(":", 1)[0]
            if str(exc).startswith("no_decide_endpoint"):
                rows = await self.indexer.score(route.model, route.tokens.tobytes(), {})
                if rows is not None:
                    d = self.decide(route.tokens, worker_view(rows).rows, up)
                    route.worker_id, route.cached_tokens, route.scored = d.worker_id, d.predicted_cached, True
            return
        self.indexer_latency.observe(time.perf_counter() - t0)
        if ans.block_size:
            self.block_size = ans.block_size
        route.worker_id, route.dp_rank = ans.worker_id, ans.dp_rank
        route.scored = ans.scored or local is not None
        route.reserved = ans.reserved
        route.after = ans.after
        route.pending_tokens = ans.pending_blocks * self.block_size
        if local is not None:
            route.cached_tokens = local.predicted_cached
        elif ans.predicted_cached_tokens is not None:
            route.cached_tokens = ans.predicted_cached_tokens
        else:
            route.cached_tokens = min(len(route.tokens), (ans.cached_blocks + ans.pending_blocks) * self.block_size)
        if not ans.scored:
            route.cached_tokens = 0  # the model is new to the indexer: nothing is cached anywhere

    def release(self, route: Route) -> None:
        """Give the route back (queued: never awaited, so a cancelled response releases it too)."""
        if route.reserved and self.indexer is not None:
            route.reserved = False
            self.indexer.release(route.model, route.request_id)

    # -- forwarding ------------------------------------------------------------------------------
    def body_for(self, raw: bytes, body: dict[str, Any], route: Route, chat: bool) -> bytes:
        if self.forward_token_ids and not chat and route.tokens is not None and isinstance(body.get("prompt"), str):
            # the engine then hashes exactly the ids that were scored
            return _enc.encode({**body, "prompt": route.tokens.tolist(), "add_special_tokens": False})
        return raw

    def _send(self, url: str, path: str, content: bytes, headers: list[tuple[bytes, bytes]]) -> Any:
        """The upstream exchange up to its head: the raw client for http://, httpx for https://."""
        if url.startswith("http://"):
            return self.raw.request(url, "POST", path, headers, content)
        return self.client.send(self.client.build_request("POST", f"{url}{path}", content=content, headers=headers),
                                stream=True)

    async def forward(self, path: str, raw: bytes, body: dict[str, Any], headers: list[tuple[bytes, bytes]],
                      route: Route, chat: bool) -> RawResponse | httpx.Response:
        """Open the upstream response (status and headers read, body not yet); retry another
        worker on a connection failure or a missed first-byte deadline. Raises NoWorker when none
        is left. Cancelled (the client left): the upstream request is closed, the route released."""
        fwd = [(k, v) for k, v in headers if k.lower() not in _DROP_REQ]
        content = self.body_for(raw, body, route, chat)
        try:
            if route.after and self.indexer is not None and self.admission_timeout_s > 0:
                # causal forwarding: the routes whose blocks the prediction counted reach the worker first
                self.counts["admission_waits"] += 1
                if not await self.indexer.wait(route.model, route.after, self.admission_timeout_s):
                    self.counts["admission_timeouts"] += 1
            while True:
                w = route.worker_id
                route.tried.append(w)
                self.inflight[w] += 1
                try:
                    resp = await within(self._send(self.workers[w], path, content, fwd), self.first_byte_timeout_s)
                except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                        UpstreamError, asyncio.TimeoutError) as exc:
                    self.inflight[w] -= 1
                    self.counts["retries"] += 1
                    if isinstance(exc, asyncio.TimeoutError):
                        self.counts["first_byte_timeouts"] += 1
                    why = "no first byte in %.1fs" % self.first_byte_timeout_s if isinstance(
                        exc, asyncio.TimeoutError) else f"{type(exc).__name__}: {exc}"
                    self.poller.mark_down(w, f"forward failed: {why}")
                    self.release(route)
                    d = self.decide(route.tokens, None, self.candidates(route.model, route.tried))
                    route.worker_id, route.cached_tokens, route.scored = d.worker_id, None, False
                    route.unscored_reason = "retried"
                    log.warning("event=retry request=%s failed_worker=%s next_worker=%s error=%s", route.request_id,
                                w, route.worker_id, why)
                    continue
                except BaseException:
                    self.inflight[w] -= 1
                    raise
                self.routed_to[w] += 1
                self.counts["routed"] += 1
                self.tally.routed(route)
                if self.lockstep is not None and route.view is not None:
                    self.lockstep.sent(w, route.view.at, {k.lower(): v for k, v in (
                        resp.headers if isinstance(resp, RawResponse) else resp.headers.items())})
                if route.reserved and self.admission_timeout_s > 0:
                    assert self.indexer is not None  # the worker queued it: routes that wait for it may go
                    self.indexer.admitted(route.model, route.request_id)  # rides on the next call
                return resp
        except BaseException:
            self.release(route)
            raise

    async def relay(self, resp: RawResponse | httpx.Response, route: Route) -> AsyncIterator[bytes]:
        """The upstream body, chunk for chunk (SSE passes through unchanged); the route is released
        and the in-flight count dropped when it ends, however it ends. An answer that breaks off
        raises Truncated after its last chunk: the client's connection is cut, not ended cleanly."""
        tail = b""
        try:
            async for chunk in resp.aiter_raw():
                tail = (tail + chunk)[-TAIL_BYTES:] if len(chunk) < TAIL_BYTES else chunk[-TAIL_BYTES:]
                yield chunk
        except (httpx.HTTPError, UpstreamError) as exc:
            self.counts["upstream_errors"] += 1
            self.counts["truncated"] += 1
            self.tally.broke(route)
            log.warning("event=upstream_broke request=%s worker=%s error=%s", route.request_id, route.worker_id, exc)
            raise Truncated(f"{route.worker_id}: {exc}") from None
        finally:
            self.inflight[route.worker_id] -= 1
            self.release(route)
            await resp.aclose()
        self._observe(route, tail)

    def _observe(self, route: Route, tail: bytes) -> None:
        if not route.scored or route.cached_tokens is None:
            self.tally.answered(route, None)
            return
        served = served_cached(tail)
        self.tally.answered(route, served)
        if served is not None:
            self.accuracy.observe(route.cached_tokens, served)

    def response_headers(self, resp: RawResponse | httpx.Response, route: Route) -> dict[str, str]:
        items = resp.headers if isinstance(resp, RawResponse) else resp.headers.items()
        out = {k: v for k, v in items if k.lower() not in _DROP_RESP}
        out["x-kvatlas-worker"] = route.worker_id
        out["x-kvatlas-route"] = route.header()
        out["x-kvatlas-request-id"] = route.request_id
        return out

