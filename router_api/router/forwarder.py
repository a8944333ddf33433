"""The router's shell: asks the indexer (`POST /score`, raw u32 body) and polls worker load, lets
the policy decide, forwards `POST /generate` and records predicted vs actual cached tokens.
Also replays a trace at scaled speed (docs/end-to-end.md, "The router").

Several replicas may run against one indexer; each knows only its own in-flight requests, the
shared index and the workers' own load reports.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Sequence

import httpx
import msgspec
import numpy as np

from router_api.router.policies import Policy, RouteInput, ScoreRow
from router_api.router.trace import TokenExpander, TraceRequest
from producer.sim.api import GenerateResponse, LoadResponse, RequestRecord, SimModel, WorkerHealth

log = logging.getLogger("kvatlas.router")
_score_dec = msgspec.json.Decoder()
_gen_dec = msgspec.json.Decoder(GenerateResponse)
_load_dec = msgspec.json.Decoder(LoadResponse)
_health_dec = msgspec.json.Decoder(WorkerHealth)
_enc = msgspec.json.Encoder()


def block_keys(tokens: np.ndarray, block: int) -> list[bytes]:
    """Chained per-block keys (equal keys = equal prefix), the router's own content ids."""
    n = len(tokens) // block
    out: list[bytes] = []
    prev = b""
    data = np.ascontiguousarray(tokens[: n * block], dtype="<u4").tobytes()
    step = block * 4
    for i in range(n):
        prev = hashlib.blake2b(prev + data[i * step:(i + 1) * step], digest_size=16).digest()
        out.append(prev)
    return out


class RouterCore:
    """One router replica's state and its async I/O."""

    def __init__(self, policy: Policy, workers: dict[str, str], indexer: str | None, model: str,
                 block_size: int, sim: SimModel, *, speed: float = 1.0, load_poll_s: float = 0.05,
                 timeout_s: float = 600.0) -> None:
        self.policy = policy
        self.workers = workers  # worker id -> base URL
        self.indexer = indexer.rstrip("/") if indexer else None
        self.model = model
        self.block_size = block_size
        self.sim = sim
        self.speed = speed
        self.load_poll_s = load_poll_s
        self.client = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=512))
        self.inflight = {w: 0 for w in workers}
        self.polled_end: dict[str, float] = {w: 0.0 for w in workers}  # virtual time the worker frees up
        self.busy_until: dict[str, float] = {w: 0.0 for w in workers}  # our own overlay of what we sent
        self.records: list[RequestRecord] = []
        self.indexer_auth: dict[str, str] = {}  # {"Authorization": "Bearer ..."} for an indexer run with auth
        self.t0 = time.monotonic()
        self._poller: asyncio.Task[None] | None = None

    def now(self) -> float:
        """Virtual seconds on the replay clock."""
        return (time.monotonic() - self.t0) * self.speed

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await self.client.aclose()

    # -- load ------------------------------------------------------------------------------
    async def _poll_once(self) -> None:
        at = self.now()

        async def one(w: str, url: str) -> None:
            try:
                r = await self.client.get(f"{url}/load", params={"at": f"{at:.6f}"}, timeout=5.0)
                if r.status_code == 200:
                    ld = _load_dec.decode(r.content)
                    self.polled_end[w] = ld.at_s + ld.backlog_s
            except (httpx.HTTPError, msgspec.DecodeError) as exc:
                log.debug("load poll of %s failed: %s", w, exc)

        await asyncio.gather(*(one(w, u) for w, u in self.workers.items()))

    async def _poll_loop(self) -> None:
        while True:
            await self._poll_once()
            await asyncio.sleep(self.load_poll_s)  # polling period (workers' load is a metric, not a lock)

    def start_polling(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_loop())

    def backlog(self, now: float) -> dict[str, float]:
        return {w: max(0.0, max(self.polled_end[w], self.busy_until[w]) - now) for w in self.workers}

    # -- score -----------------------------------------------------------------------------
    async def score(self, tokens: np.ndarray) -> dict[str, ScoreRow]:
        assert self.indexer is not None
        r = await self.client.post(f"{self.indexer}/score", params={"model": self.model},
                                   content=np.ascontiguousarray(tokens, dtype="<u4").tobytes(),
                                   headers={"Content-Type": "application/octet-stream", **self.indexer_auth},
                                   timeout=30.0)
        if r.status_code == 404:  # model not known yet: no worker has published anything
            return {}
        r.raise_for_status()
        out: dict[str, ScoreRow] = {}
        for row in _score_dec.decode(r.content)["workers"]:
            t = row["tiers"]
            out[row["worker_id"]] = ScoreRow(row["device_blocks"], row["cached_blocks"], t.get("host", 0),
                                             t.get("disk", 0), t.get("shared", 0))
        return out

    # -- one request -----------------------------------------------------------------------
    async def handle(self, index: int, tokens: np.ndarray, max_tokens: int, arrival_s: float | None = None,
                     request_id: str | None = None) -> tuple[RequestRecord, GenerateResponse | None]:
        now = self.now() if arrival_s is None else arrival_s
        pol = self.policy
        rec = RequestRecord(index=index, worker_id="", input_tokens=len(tokens))
        try:
            scores = await self.score(tokens) if pol.uses_index else None
            keys = block_keys(tokens, self.block_size) if pol.name == "approximate" else []
            d = pol.choose(RouteInput(len(tokens), keys, self.block_size, scores, self.backlog(now), self.inflight))
        except (httpx.HTTPError, msgspec.DecodeError, KeyError, TypeError) as exc:
            rec.error = f"route: {exc}"
            self.records.append(rec)
            return rec, None
        w = d.worker_id
        rec.worker_id = w
        rec.predicted_cached = d.predicted_cached
        self.busy_until[w] = max(self.busy_until[w], self.polled_end[w], now) + d.est_cost_s
        self.inflight[w] += 1
        body = _enc.encode({"token_ids": tokens.tolist(), "max_tokens": max_tokens, "arrival_s": now,
                            "request_id": request_id or str(index)})
        resp = None
        try:
            r = await self.client.post(f"{self.workers[w]}/generate", content=body,
                                       headers={"Content-Type": "application/json"})
            if r.status_code != 200:
                rec.error = f"worker {w}: HTTP {r.status_code} {r.text[:200]}"
            else:
                resp = _gen_dec.decode(r.content)
                rec.arrival_cached = resp.arrival_cached
                rec.served = resp.served
                rec.ttft_s = resp.ttft_s
                rec.queue_s = resp.queue_s
        except (httpx.HTTPError, msgspec.DecodeError) as exc:
            rec.error = f"worker {w}: {type(exc).__name__}: {exc}"
        finally:
            self.inflight[w] -= 1
        self.records.append(rec)
        return rec, resp

    # -- trace replay ----------------------------------------------------------------------
    async def replay(self, reqs: Sequence[TraceRequest], on_done: Callable[[int], None] | None = None,
                     start_at: float | None = None) -> list[RequestRecord]:
        """Send each request at its arrival time / speed (start_at: wall-clock epoch of t=0)."""
        expander = TokenExpander()
        if start_at is not None:
            self.t0 = time.monotonic() + max(0.0, start_at - time.time())
        else:
            self.t0 = time.monotonic()
        self.start_polling()
        done = 0

        async def one(r: TraceRequest) -> None:
            nonlocal done
            await self.handle(r.index, expander.tokens(r), r.output_length, r.arrival_s)
            done += 1
            if on_done is not None:
                on_done(done)

        tasks = []
        for r in reqs:
            delay = self.t0 + r.arrival_s / self.speed - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing to the trace's clock
            tasks.append(asyncio.create_task(one(r)))
        await asyncio.gather(*tasks)
        return self.records


async def fetch_sim(client: httpx.AsyncClient, url: str, deadline_s: float = 60.0) -> WorkerHealth:
    """A worker's health (its simulated model and block size), waiting for it to come up. A server
    that answers but is not a `kvatlas worker` (vLLM's empty /health body, a 404) is a ValueError
    at once, naming the fix; an unreachable one is retried (logged) until the deadline."""
    end = time.monotonic() + deadline_s
    logged = False
    while True:
        try:
            r = await client.get(f"{url.rstrip('/')}/health", timeout=5.0)
        except httpx.HTTPError as exc:
            if not logged:
                log.warning("event=waiting_for_worker url=%s error=%s", url, exc)
                logged = True
        else:
            if r.status_code == 200:
                try:
                    return _health_dec.decode(r.content)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    pass
            raise ValueError(f"worker {url} answered /health with HTTP {r.status_code} {r.content[:80]!r}, "
                             "not as a kvatlas worker: for vLLM / SGLang engines run the router with --api openai")
        if time.monotonic() > end:
            raise TimeoutError(f"worker {url} did not become healthy")
        await asyncio.sleep(0.1)  # readiness poll
