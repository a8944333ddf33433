"""The OpenAI proxy's routing shell (docs/openai.md): tokenize the request as the engine will, score
it at the indexer, let the policy pick among the workers that are up, report the in-flight route
(`POST /routes`, released with `DELETE /routes/{id}` when the response ends), forward, and retry
another worker on a connection failure before the first byte.

Nothing here fails a request the engines would serve: without a tokenizer, with messages the
template refuses, or with the indexer unreachable the request is routed on load alone (logged,
rate-limited); only "no worker is up" answers 503.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator

import httpx
import msgspec
import numpy as np

from sim.api import SimModel
from sim.httpbody import CLIENT_KEEPALIVE_S
from router_api.router.policies import Decision, Policy, RouteInput, ScoreRow, make_policy, shared_backlog
from router_api.tokenization import ChatTokenizer, TokenizerError
from router_api.proxy.load import LoadPoller

log = logging.getLogger("kvatlas.router")
_dec = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()
# Request headers not forwarded (hop-by-hop, or recomputed by the client library).
_DROP_REQ = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade",
                       "te", "trailer", "proxy-authorization", "proxy-connection", "accept-encoding"})
_DROP_RESP = frozenset({"connection", "keep-alive", "transfer-encoding", "upgrade", "te", "trailer", "date", "server",
                        "content-length"})


class NoWorker(Exception):
    """No worker is up (or every one failed before its first byte)."""


class Route:
    """One routed request: the decision and what was scored."""

    __slots__ = ("request_id", "worker_id", "tokens", "cached_tokens", "policy", "tried", "reported", "ranks")

    def __init__(self, request_id: str, tokens: np.ndarray | None, policy: str) -> None:
        self.request_id = request_id
        self.worker_id = ""
        self.ranks: dict[str, int] = {}  # per worker, the dp rank of its best /score row (reported with the route)
        self.tokens = tokens
        self.cached_tokens: int | None = None
        self.policy = policy
        self.tried: list[str] = []
        self.reported: asyncio.Task[bool] | None = None

    def header(self) -> str:
        parts = [f"worker={self.worker_id}", f"policy={self.policy}",
                 f"prompt_tokens={'' if self.tokens is None else len(self.tokens)}",
                 f"predicted_cached_tokens={'' if self.cached_tokens is None else self.cached_tokens}",
                 f"retries={max(0, len(self.tried) - 1)}"]
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
                 connect_timeout_s: float = 2.0, read_timeout_s: float = 600.0,
                 indexer_token: str | None = None) -> None:
        self.workers = workers
        self.indexer = indexer.rstrip("/") if indexer else None
        self.model = model
        self.tokenizer = tokenizer
        self.policy_name = policy
        self.sim = sim or SimModel()
        self.block_size = block_size
        self.forward_token_ids = forward_token_ids
        self.report_routes = report_routes and self.indexer is not None
        # the indexer's bearer token (`kvatlas indexer --auth-token-file`), sent on /score and /routes only
        self._auth = {"Authorization": f"Bearer {indexer_token}"} if indexer_token else {}
        self.seed = seed
        make_policy(policy, list(workers), self.sim, seed)  # fail at start on a bad name
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s),
                                        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256,
                                                            keepalive_expiry=CLIENT_KEEPALIVE_S))
        self.poller = LoadPoller(workers, self.client, interval_s=metrics_interval_s)
        self._policies: dict[tuple[str, ...], Policy] = {}
        self.inflight = {w: 0 for w in workers}
        self.counts = {"requests": 0, "routed": 0, "retries": 0, "no_worker": 0, "unscored": 0, "upstream_errors": 0}
        self.routed_to = {w: 0 for w in workers}
        self._warn = _OnceLog()
        self._avg_tokens = 1024.0

    async def start(self) -> None:
        await self.poller.poll_all()  # a first reading before serving: down workers are known at once
        self.poller.start()

    async def close(self) -> None:
        await self.poller.close()
        await self.client.aclose()

    # -- tokens and scores ---------------------------------------------------------------------
    def tokens_of(self, body: dict[str, Any], chat: bool) -> list[int] | None:
        """The ids the engine will make of this request, or None when they cannot be known here."""
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
                                       tools=body.get("tools"),
                                       template_kwargs=body.get("chat_template_kwargs") or None)
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                return None
            return tok.encode_prompt(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
        except TokenizerError as exc:
            self._warn.warning("bad_text", "event=unscored reason=tokenize_failed error=%s", exc)
            return None

    async def score(self, tokens: np.ndarray, body: dict[str, Any],
                    ranks: dict[str, int] | None = None) -> dict[str, ScoreRow] | None:
        if self.indexer is None:
            return None
        params = {"model": self.model}
        for k in ("lora_name", "cache_salt"):
            if isinstance(body.get(k), str):
                params[k] = body[k]
        try:
            r = await self.client.post(f"{self.indexer}/score", params=params, content=tokens.tobytes(),
                                       headers={"Content-Type": "application/octet-stream", **self._auth},
                                       timeout=5.0)
            if r.status_code == 404:  # the model is not known yet: nothing cached anywhere
                return {}
            r.raise_for_status()
            ans = _dec.decode(r.content)
        except (httpx.HTTPError, msgspec.DecodeError) as exc:
            self._warn.warning("score", "event=unscored reason=indexer_unreachable url=%s error=%s", self.indexer, exc)
            return None
        self.block_size = int(ans.get("block_size") or self.block_size)
        out: dict[str, ScoreRow] = {}
        load: dict[str, tuple[int, int]] = {}  # per worker, its ranks' in-flight load together
        for row in ans.get("workers", []):
            prev = out.get(row["worker_id"])
            cur = ScoreRow.from_answer(row)
            n, t = load.get(row["worker_id"], (0, 0))
            load[row["worker_id"]] = (n + cur.inflight, t + cur.inflight_prefill)
            if prev is None or cur.cached > prev.cached:  # per worker, its best dp rank
                out[row["worker_id"]] = cur
                if ranks is not None:
                    ranks[row["worker_id"]] = int(row.get("dp_rank", 0))
        for w, row in out.items():
            row.inflight, row.inflight_prefill = load[w]
        return out

    # -- deciding --------------------------------------------------------------------------------
    def _policy(self, up: list[str]) -> Policy:
        key = tuple(up)
        p = self._policies.get(key)
        if p is None:
            if len(self._policies) > 64:
                self._policies.clear()
            p = self._policies[key] = make_policy(self.policy_name, up, self.sim, self.seed)
        return p

    def decide(self, tokens: np.ndarray | None, scores: dict[str, ScoreRow] | None, exclude: list[str]) -> Decision:
        up = [w for w in self.poller.up() if w not in exclude]
        if not up:
            raise NoWorker("no worker is up: " + "; ".join(
                f"{w}: {st.reason if w not in exclude else 'failed before its first byte'}"
                for w, st in self.poller.states.items()))
        pol = self._policy(up)
        n = 0 if tokens is None else len(tokens)
        per_request = self.sim.prefill_s(int(self._avg_tokens))
        backlog = {w: (self.poller.states[w].load.waiting or 0.0) * per_request for w in up}
        if scores:
            # Every router replica's routes not yet confirmed: a real engine stores a request's blocks once
            # its prefill ran, so they are the requests queued or prefilling there (the polled `waiting`
            # among them, once the poll sees them): the larger of the two views, not their sum.
            for w in up:
                row = scores.get(w)
                if row is not None:
                    backlog[w] = max(backlog[w], shared_backlog(self.sim, 0.0, row))
        keys: list[bytes] = []
        if pol.name == "approximate" and tokens is not None:
            from router_api.router.forwarder import block_keys

            keys = block_keys(tokens, self.block_size)
        return pol.choose(RouteInput(n, keys, self.block_size, scores if pol.uses_index else None, backlog,
                                     self.inflight))

    async def route(self, body: dict[str, Any], chat: bool) -> Route:
        # Inline, not in a thread: encoding holds the GIL anyway, and a shared system prompt comes
        # from the piece cache (tens of microseconds), less than a thread hop costs.
        ids = self.tokens_of(body, chat)
        tokens = None if ids is None else np.asarray(ids, dtype="<u4")
        # unique across router replicas sharing one indexer (its in-flight routes are keyed by this id)
        route = Route(f"kvatlas-{uuid.uuid4().hex}", tokens, self.policy_name)
        if tokens is not None:
            self._avg_tokens = 0.9 * self._avg_tokens + 0.1 * len(tokens)
        scores = await self.score(tokens, body, route.ranks) if tokens is not None else None
        if scores is None:
            self.counts["unscored"] += 1
        d = self.decide(tokens, scores, [])
        route.worker_id = d.worker_id
        route.cached_tokens = d.predicted_cached
        return route

    # -- in-flight routes at the indexer ---------------------------------------------------------
    async def _report(self, route: Route, body: dict[str, Any]) -> bool:
        if not self.report_routes or route.tokens is None:
            return False
        doc = {"model": self.model, "request_id": route.request_id, "worker_id": route.worker_id,
               "dp_rank": route.ranks.get(route.worker_id, 0),
               "token_ids": route.tokens.tolist(), "lora_name": body.get("lora_name"),
               "cache_salt": body.get("cache_salt")}
        try:
            r = await self.client.post(f"{self.indexer}/routes", content=_enc.encode(doc),
                                       headers={"Content-Type": "application/json", **self._auth}, timeout=5.0)
        except httpx.HTTPError as exc:
            self._warn.warning("routes", "event=route_report_failed url=%s error=%s", self.indexer, exc)
            return False
        if r.status_code in (404, 405):
            self.report_routes = False  # an indexer without in-flight routes: say so once, go on
            log.warning("event=route_reports_off url=%s detail=the indexer has no POST /routes (HTTP %d); "
                        "routing goes on without in-flight reports", self.indexer, r.status_code)
            return False
        return r.status_code == 200

    async def release(self, route: Route) -> None:
        task = route.reported
        if task is None:
            return
        try:
            if not await task:
                return
            await self.client.delete(f"{self.indexer}/routes/{route.request_id}", params={"model": self.model},
                                     headers=self._auth, timeout=5.0)
        except (httpx.HTTPError, asyncio.CancelledError) as exc:
            self._warn.warning("release", "event=route_release_failed request=%s error=%r", route.request_id, exc)

    # -- forwarding ------------------------------------------------------------------------------
    def body_for(self, raw: bytes, body: dict[str, Any], route: Route, chat: bool) -> bytes:
        if self.forward_token_ids and not chat and route.tokens is not None and isinstance(body.get("prompt"), str):
            # the engine then hashes exactly the ids that were scored
            return _enc.encode({**body, "prompt": route.tokens.tolist(), "add_special_tokens": False})
        return raw

    async def forward(self, path: str, raw: bytes, body: dict[str, Any], headers: list[tuple[bytes, bytes]],
                      route: Route, chat: bool) -> httpx.Response:
        """Open the upstream response (status and headers read, body not yet); retry another
        worker on a connection failure. Raises NoWorker when none is left."""
        fwd = [(k, v) for k, v in headers if k.decode("latin-1").lower() not in _DROP_REQ]
        content = self.body_for(raw, body, route, chat)
        while True:
            w = route.worker_id
            route.tried.append(w)
            self.inflight[w] += 1
            if route.reported is None:
                route.reported = asyncio.create_task(self._report(route, body))
            req = self.client.build_request("POST", f"{self.workers[w]}{path}", content=content, headers=fwd)
            try:
                resp = await self.client.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                self.inflight[w] -= 1
                self.counts["retries"] += 1
                self.poller.mark_down(w, f"forward failed: {type(exc).__name__}: {exc}")
                await self.release(route)
                route.reported = None
                d = self.decide(route.tokens, None, route.tried)  # raises NoWorker when none is left
                route.worker_id = d.worker_id
                route.cached_tokens = d.predicted_cached
                log.warning("event=retry request=%s failed_worker=%s next_worker=%s error=%s", route.request_id,
                            w, route.worker_id, type(exc).__name__)
                continue
            self.routed_to[w] += 1
            self.counts["routed"] += 1
            return resp

    async def relay(self, resp: httpx.Response, route: Route) -> AsyncIterator[bytes]:
        """The upstream body, chunk for chunk (SSE passes through unchanged); the route is released
        and the in-flight count dropped when it ends, however it ends."""
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            self.counts["upstream_errors"] += 1
            log.warning("event=upstream_broke request=%s worker=%s error=%s", route.request_id, route.worker_id, exc)
        finally:
            await resp.aclose()
            self.inflight[route.worker_id] -= 1
            await self.release(route)

    def response_headers(self, resp: httpx.Response, route: Route) -> dict[str, str]:
        out = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_RESP}
        out["x-kvatlas-worker"] = route.worker_id
        out["x-kvatlas-route"] = route.header()
        out["x-kvatlas-request-id"] = route.request_id
        return out
