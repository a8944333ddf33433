"""The router's shell: asks the indexer (`POST /score`, raw u32 body) and polls worker load, lets
the policy decide, reports the route, forwards `POST /generate` — once the worker admitted the
in-flight requests whose blocks the prediction counted (causal forwarding) — and records predicted
vs actual cached tokens. Also replays a trace at scaled speed (docs/end-to-end.md, "The router").

Several replicas may run against one indexer; each knows only its own in-flight requests, the
shared index and the workers' own load reports.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence

import httpx
import msgspec
import numpy as np

from router.policies import Policy, RouteInput, ScoreRow, shared_backlog
from router.pacing import send_paced
from router.trace import TokenExpander, TraceRequest
from schemas.api import MAX_WAIT_ROUTES, MAX_WAIT_S
from sim.api import GenerateResponse, LoadResponse, SimModel, WorkerHealth
from router.records import RequestRecord

log = logging.getLogger("kvatlas.router")
_score_dec = msgspec.json.Decoder()
_gen_dec = msgspec.json.Decoder(GenerateResponse)
_load_dec = msgspec.json.Decoder(LoadResponse)
_health_dec = msgspec.json.Decoder(WorkerHealth)
_enc = msgspec.json.Encoder()
_mp_enc = msgspec.msgpack.Encoder()
_NO_LOCK = contextlib.nullcontext()
# The farthest ahead of now (virtual seconds) an end time is believed, from any replica or our own
# overlay: within the indexer's own bound on `busy_until`, and short enough that one hostile report
# cannot park a worker for longer than a long queue would.
MAX_AHEAD_S = 3600.0


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


def describe(exc: BaseException) -> str:
    """An HTTP error with the chain under it: a bare `ReadError` says neither who closed the connection
    (ClosedResourceError: this client; BrokenResourceError: the peer) nor why."""
    parts = []
    e: BaseException | None = exc
    while e is not None and len(parts) < 4:
        parts.append(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


class RouterCore:
    """One router replica's state and its async I/O."""

    def __init__(self, policy: Policy, workers: dict[str, str], indexer: str | None, model: str,
                 block_size: int, sim: SimModel, *, speed: float = 1.0, load_poll_s: float = 0.05,
                 timeout_s: float = 600.0, serial: bool = True, admission_timeout_s: float = 2.0) -> None:
        self.policy = policy
        self.workers = workers  # worker id -> base URL
        self.indexer = indexer.rstrip("/") if indexer else None
        self.model = model
        self.block_size = block_size
        self.sim = sim
        self.speed = speed
        self.load_poll_s = load_poll_s
        # idle connections are kept until the worker closes them (sim.httpbody, WORKER_KEEPALIVE_S)
        self.client = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=512,
                                                                               keepalive_expiry=None))
        self.inflight = {w: 0 for w in workers}
        self.polled_end: dict[str, float] = {w: 0.0 for w in workers}  # virtual time the worker frees up
        self.busy_until: dict[str, float] = {w: 0.0 for w in workers}  # our own overlay of what we sent
        self.shared_until: dict[str, float] = {w: 0.0 for w in workers}  # every replica's, from /score rows
        self.records: list[RequestRecord] = []
        self.indexer_auth: dict[str, str] = {}  # {"Authorization": "Bearer ..."} for an indexer run with auth
        self.route_errors = 0
        self.unauthorized = 0  # route calls the indexer refused with 401/403
        # Causal forwarding: wall seconds a request waits at most for the routes its prediction counted
        # to be admitted by their worker (0: it does not wait, nor report admissions)
        self.admission_timeout_s = admission_timeout_s
        self._admits: set[asyncio.Task[None]] = set()  # admission reports in flight
        self._deciding = asyncio.Lock()
        self.serial = serial
        self.route_prefix = os.urandom(4).hex()  # request ids unique across router replicas
        self.t0 = time.monotonic()
        self._poller: asyncio.Task[None] | None = None

    def now(self) -> float:
        """Virtual seconds on the replay clock."""
        return (time.monotonic() - self.t0) * self.speed

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self._admits:
            await asyncio.gather(*self._admits, return_exceptions=True)
        await self.client.aclose()

    # -- load ------------------------------------------------------------------------------
    async def _poll_once(self) -> None:
        at = self.now()

        async def one(w: str, url: str) -> None:
            try:
                r = await self.client.get(f"{url}/load", params={"at": f"{at:.6f}"}, timeout=5.0)
                if r.status_code == 200:
                    ld = _load_dec.decode(r.content)
                    # The absolute end of the worker's committed work: `at_s + backlog_s` would never be
                    # below `at` (now on this router's clock) and flatten every worker's backlog to the
                    # router's lag when it runs behind its trace.
                    self.polled_end[w] = ld.free_at_s if ld.free_at_s is not None else ld.at_s + ld.backlog_s
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

    def backlog(self, now: float, scores: dict[str, ScoreRow] | None = None) -> dict[str, float]:
        """Virtual seconds of work queued ahead of a request arriving at `now`, per worker: the larger
        of this replica's view (the worker's last report overlaid with what this replica sent since)
        and the shared one (that report plus every replica's unconfirmed routes, from the `/score`
        rows). The shared view is kept as an end time until it passes: a route drops out of the rows
        once the worker's events confirm it, maybe before the worker's next load report shows it."""
        if scores:
            for w, row in scores.items():
                if w not in self.shared_until:
                    continue
                # The rows say what is in flight now and are believed (bounded to MAX_AHEAD_S); what was
                # kept from earlier rows counts only a short while past now (until the workers' next
                # load reports carry that work): a largest-ever value would keep one hostile or stale
                # report for good.
                kept = min(self.shared_until[w], max(now, self.polled_end[w]) + self.linger_s())
                if row.busy_until is not None:  # every replica's own overlay, reported with its routes
                    cur = min(row.busy_until, now + MAX_AHEAD_S)
                elif row.inflight:  # routers that report no end time: their unconfirmed routes' prefill
                    reported = max(0.0, self.polled_end[w] - now)
                    cur = min(now + shared_backlog(self.sim, reported, row), now + MAX_AHEAD_S)
                else:
                    cur = 0.0
                self.shared_until[w] = max(cur, kept)
        return {w: max(0.0, max(self.polled_end[w], self.busy_until[w], self.shared_until[w]) - now)
                for w in self.workers}

    def linger_s(self) -> float:
        """Virtual seconds a confirmed route's end time is kept: until the workers' next load reports
        (a few poll periods), which then carry that work themselves."""
        return 4 * self.load_poll_s * self.speed

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
            out[row["worker_id"]] = ScoreRow.from_answer(row)
        return out

    # -- in-flight routes (docs/CONTRACTS.md, "Pending routes") ----------------------------
    async def report_route(self, request_id: str, worker_id: str, tokens: np.ndarray) -> dict | None:
        """Tell the indexer where this request goes, so every router replica counts its blocks as
        pending on that worker until the worker's own events land, and sees the end time this replica
        expects for that worker's work (`busy_until`, on the replay clock the replicas share)."""
        assert self.indexer is not None
        body = _mp_enc.encode({"model": self.model, "request_id": request_id, "worker_id": worker_id,
                               "token_ids": tokens.tolist(), "busy_until": self.busy_until[worker_id],
                               "admits": self.admission_timeout_s > 0})
        try:
            r = await self.client.post(f"{self.indexer}/routes", content=body,
                                       headers={"Content-Type": "application/msgpack", **self.indexer_auth},
                                       timeout=30.0)
        except httpx.HTTPError as exc:  # routing goes on; other routers just do not see this one
            self.route_errors += 1
            log.debug("route report %s -> %s failed: %s", request_id, worker_id, exc)
            return None
        if r.status_code != 200:
            self.route_errors += 1
            self._refused(r.status_code, "routes")
            log.debug("route report %s -> %s: HTTP %d %s", request_id, worker_id, r.status_code, r.text[:200])
            return None
        return _score_dec.decode(r.content)

    async def wait_admitted(self, request_ids: list[str]) -> tuple[float, bool]:
        """Causal forwarding: wait until the worker admitted one of the routes holding the blocks this
        request's prediction counted (their routers report it), at most `admission_timeout_s`;
        (wall seconds, timed out)."""
        assert self.indexer is not None
        t0 = time.monotonic()
        body = _mp_enc.encode({"model": self.model, "request_ids": request_ids[:MAX_WAIT_ROUTES],
                               "timeout_s": min(self.admission_timeout_s, MAX_WAIT_S)})
        try:
            r = await self.client.post(f"{self.indexer}/routes/wait", content=body,
                                       headers={"Content-Type": "application/msgpack", **self.indexer_auth},
                                       timeout=self.admission_timeout_s + 30.0)
            left = _score_dec.decode(r.content)["waiting"] if r.status_code == 200 else request_ids
        except (httpx.HTTPError, msgspec.DecodeError, KeyError, TypeError) as exc:
            self.route_errors += 1
            log.debug("admission wait for %s failed: %s", request_ids, exc)
            left = request_ids
        # one admitted suffices: each of them holds every block the prediction counted
        return time.monotonic() - t0, len(set(left)) >= len(set(request_ids[:MAX_WAIT_ROUTES]))

    def admitted(self, request_id: str) -> None:
        """The worker began its answer, so it has the request queued: tell the indexer (in the
        background: the forward goes on), so the routes that wait for it may go."""
        assert self.indexer is not None
        body = _mp_enc.encode({"model": self.model, "request_id": request_id})

        async def send() -> None:
            try:
                await self.client.post(f"{self.indexer}/routes/admitted", content=body,
                                       headers={"Content-Type": "application/msgpack", **self.indexer_auth},
                                       timeout=30.0)
            except httpx.HTTPError as exc:  # a waiter times out instead
                self.route_errors += 1
                log.debug("admission report %s failed: %s", request_id, exc)

        task = asyncio.get_running_loop().create_task(send())
        self._admits.add(task)
        task.add_done_callback(self._admits.discard)

    async def release_route(self, request_id: str) -> None:
        assert self.indexer is not None
        try:
            r = await self.client.delete(f"{self.indexer}/routes/{request_id}", params={"model": self.model},
                                         headers=self.indexer_auth, timeout=30.0)
        except httpx.HTTPError as exc:  # the indexer's TTL forgets it anyway
            self.route_errors += 1
            log.debug("route release %s failed: %s", request_id, exc)
            return
        if r.status_code != 200:
            self.route_errors += 1
            self._refused(r.status_code, "release")

    def _refused(self, status: int, what: str) -> None:
        """An indexer answer other than 200 to a route call: 401/403 are counted apart and said once
        (a missing or wrong --indexer-token-file turns in-flight reporting off silently otherwise)."""
        if status in (401, 403):
            self.unauthorized += 1
            if self.unauthorized == 1:
                log.warning("event=indexer_refused what=%s status=%d detail=the indexer wants a bearer token: "
                            "give --indexer-token-file (or $KVATLAS_AUTH_TOKEN)", what, status)

    # -- one request -----------------------------------------------------------------------
    async def handle(self, index: int, tokens: np.ndarray, max_tokens: int, arrival_s: float | None = None,
                     request_id: str | None = None) -> tuple[RequestRecord, GenerateResponse | None]:
        now = self.now() if arrival_s is None else arrival_s
        pol = self.policy
        rec = RequestRecord(index=index, worker_id="", input_tokens=len(tokens))
        rid = request_id or str(index)
        route_id = f"{self.route_prefix}-{rid}" if pol.uses_index else None
        after: list[str] = []
        try:
            # One decision at a time per replica (score -> choose -> report): each sees the routes this
            # replica reported before it, and requests reach the workers in trace order even when the
            # router runs behind its trace (its decisions then do not depend on the machine's load).
            async with self._deciding if pol.uses_index and self.serial else _NO_LOCK:
                scores = await self.score(tokens) if pol.uses_index else None
                keys = block_keys(tokens, self.block_size) if pol.name == "approximate" else []
                d = pol.choose(RouteInput(len(tokens), keys, self.block_size, scores, self.backlog(now, scores),
                                          self.inflight))
                w = d.worker_id
                rec.worker_id = w
                rec.predicted_cached = d.predicted_cached
                self.busy_until[w] = min(max(self.busy_until[w], self.polled_end[w], self.shared_until[w], now)
                                         + d.est_cost_s, now + MAX_AHEAD_S)
                self.inflight[w] += 1
                if route_id is not None:
                    rec.predicted_pending = d.predicted_pending
                    got = await self.report_route(route_id, w, tokens)
                    if got is not None:  # the index's view at the report, fresher than at the score
                        b = self.block_size
                        blocks = pol.predicted_at_report(  # type: ignore[attr-defined]
                            (scores or {}).get(w), got["cached_blocks"], got["pending_blocks"])
                        rec.predicted_cached = min(len(tokens), blocks * b)
                        rec.predicted_pending = got["pending_blocks"] * b
                        after = got.get("after") or []
        except (httpx.HTTPError, msgspec.DecodeError, KeyError, TypeError) as exc:
            rec.error = f"route: {exc}"
            self.records.append(rec)
            if rec.worker_id:
                self.inflight[rec.worker_id] -= 1
            return rec, None
        if after and self.admission_timeout_s > 0:
            # Its prediction counts blocks of routes the worker has not admitted yet: reaching the
            # worker before them, it would compute what it was promised from cache (a FIFO queue then
            # runs it after them). Outside the decision lock: other requests are decided meanwhile.
            rec.wait_s, rec.wait_timeout = await self.wait_admitted(after)
        body = _enc.encode({"token_ids": tokens.tolist(), "max_tokens": max_tokens, "arrival_s": now,
                            "request_id": rid})
        resp = None
        try:
            async with self.client.stream("POST", f"{self.workers[w]}/generate", content=body,
                                          headers={"Content-Type": "application/json"}) as r:
                if r.status_code == 200 and route_id is not None and self.admission_timeout_s > 0:
                    self.admitted(route_id)  # its answer began: the worker has queued it
                await r.aread()
            if r.status_code != 200:
                rec.error = f"worker {w}: HTTP {r.status_code} {r.text[:200]}"
            else:
                resp = _gen_dec.decode(r.content)
                rec.arrival_cached = resp.arrival_cached
                rec.served = resp.served
                rec.ttft_s = resp.ttft_s
                rec.queue_s = resp.queue_s
        except (httpx.HTTPError, msgspec.DecodeError) as exc:
            rec.error = f"worker {w}: {describe(exc)}"
        finally:
            self.inflight[w] -= 1
            if route_id is not None:
                await self.release_route(route_id)
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
        async def send(r: TraceRequest) -> None:
            await self.handle(r.index, expander.tokens(r), r.output_length, r.arrival_s)

        await send_paced(reqs, self.t0, self.speed, send, on_done)
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
