"""The OpenAI proxy's calls to the indexer (docs/openai.md, "One round trip"): one
`POST /routes/decide` per request (score + choose + reserve, atomically at the indexer), the
causal-forwarding wait, and admission reports and releases off the request path: each rides on the
router's next decision, or goes in a batch (`POST /routes/release`) when no request comes (an
admission within `admit_every_s`, a release within `release_every_s`).

It also keeps what an operator must see: whether the indexer answers (`state`, the router's
`/health` says `degraded` and why), 401s counted, per-worker refusals (an id the indexer does not
know is a warning for that worker and a metric, never a switch that turns reporting off), and a
missing endpoint retried with backoff.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any
from urllib.parse import quote

import httpx
import msgspec

from router.proxy.rawhttp import RawClient, UpstreamError
from router_api.decide import MAX_RELEASE, DecideAnswer, DecideRequest, ReleaseRequest
from schemas.api import MAX_WAIT_ROUTES, MAX_WAIT_S

log = logging.getLogger("kvatlas.router")
_mp = msgspec.msgpack.Encoder()
_answer = msgspec.msgpack.Decoder(DecideAnswer)
_plain = msgspec.msgpack.Decoder()
MSGPACK = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
_ERRORS = (httpx.HTTPError, UpstreamError)


class _Answer:
    __slots__ = ("status_code", "content")

    def __init__(self, status: int, content: bytes) -> None:
        self.status_code = status
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class Unavailable(Exception):
    """The indexer did not decide (unreachable, refusing, or without the endpoint): route locally."""


class IndexerClient:
    def __init__(self, url: str, client: httpx.AsyncClient, token: str | None, *, timeout_s: float = 2.0,
                 release_every_s: float = 0.05, admit_every_s: float = 0.002, max_backoff_s: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.client = client
        # plain http: the pooled raw client (about a tenth of httpx's CPU per call); https: httpx
        self.raw = RawClient() if self.url.startswith("http://") else None
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._msgpack = {**MSGPACK, **self.auth}  # the headers of every msgpack call, built once
        self._msgpack_raw = [(k.encode(), v.encode()) for k, v in self._msgpack.items()]
        self.timeout_s = timeout_s
        self.release_every_s = release_every_s
        self.admit_every_s = admit_every_s
        self.max_backoff_s = max_backoff_s
        self.state = "ok"   # ok | unreachable: ... | refusing: ... | no_decide_endpoint: ...
        self.since = time.monotonic()
        self.counts = {"decided": 0, "unreachable": 0, "unauthorized": 0, "refused": 0, "missing_endpoint": 0,
                       "released": 0, "release_failed": 0, "unknown_worker": 0,
                       "admitted": 0, "admit_failed": 0}
        self.unknown_workers: dict[str, int] = {}  # worker id -> decisions the indexer could not record
        self._missing_until = 0.0
        self._backoff_s = 1.0
        self._releases: dict[str, list[str]] = {}  # model -> route ids to release
        self._admits: dict[str, list[str]] = {}    # model -> route ids the worker admitted, to report
        self._started = False
        self._timer: asyncio.TimerHandle | None = None  # the next batch, when nothing carried the reports
        self._flushing: asyncio.Task[None] | None = None
        self._warned: dict[str, float] = {}

    # -- health ------------------------------------------------------------------------------
    def _set(self, state: str) -> None:
        if state != self.state:
            (log.info if state == "ok" else log.warning)("event=indexer_state url=%s state=%s", self.url, state)
            self.state = state
            self.since = time.monotonic()

    def _warn(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now >= self._warned.get(key, 0.0):
            self._warned[key] = now + 30.0
            log.warning(msg, *args)

    async def _call(self, method: str, path: str, body: bytes, headers: dict[str, str], timeout_s: float,
                    params: dict[str, str] | None = None) -> _Answer:
        if params:
            path = path + "?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in params.items())
        if self.raw is not None:
            raw_headers = self._msgpack_raw if headers is self._msgpack else [
                (k.encode(), v.encode()) for k, v in headers.items()]
            status, data = await self.raw.call(self.url, method, path, raw_headers, body, timeout_s)
            return _Answer(status, data)
        r = await self.client.request(method, f"{self.url}{path}", content=body, headers=headers, timeout=timeout_s)
        return _Answer(r.status_code, r.content)

    # -- deciding ------------------------------------------------------------------------------
    async def decide(self, req: DecideRequest) -> DecideAnswer:
        """One round trip: the indexer scores, chooses (or takes `req.choice`) and records the route.
        Raises Unavailable when it did not (the caller routes on its own, unscored or on /score)."""
        if time.monotonic() < self._missing_until:
            raise Unavailable(self.state)
        # this router's admissions and finished routes go first
        riding = req.release = self._take(self._releases, req.model)
        admits = req.admitted = self._take(self._admits, req.model)
        try:
            r = await self._call("POST", "/routes/decide", _mp.encode(req), self._msgpack, self.timeout_s)
        except _ERRORS as exc:
            self._requeue(req.model, riding, admits)
            self.counts["unreachable"] += 1
            self._set(f"unreachable: {type(exc).__name__}: {exc}".strip())
            raise Unavailable(self.state) from None
        except asyncio.CancelledError:
            # the client left mid-call: the indexer may have reserved this route and applied the riding
            # reports, or not; they go out again (releasing or admitting twice is a no-op), none waits
            # for its TTL
            self._requeue(req.model, riding, admits)
            if req.reserve:
                self.release(req.model, req.request_id)
            raise
        if r.status_code == 200:
            try:
                ans = _answer.decode(r.content)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._set(f"refusing: unreadable answer: {exc}")
                raise Unavailable(self.state) from None
            self.counts["decided"] += 1
            self.counts["released"] += len(riding)
            self.counts["admitted"] += len(admits)
            self._backoff_s = 1.0
            self._set("ok")
            if ans.refused is not None:
                self.counts["unknown_worker"] += 1
                self.unknown_workers[ans.worker_id] = self.unknown_workers.get(ans.worker_id, 0) + 1
                self._warn(f"refused:{ans.worker_id}", "event=route_not_recorded worker=%s reason=%s detail=this "
                           "worker's routes are not in flight at the indexer (others are)", ans.worker_id, ans.refused)
            return ans
        self._requeue(req.model, riding, admits)
        detail = r.text[:200]
        if r.status_code in (401, 403):
            self.counts["unauthorized"] += 1
            self._set(f"refusing: HTTP {r.status_code} (give --indexer-token-file): {detail}")
        elif r.status_code in (404, 405, 501):
            # an indexer without the endpoint (or without a chooser): retried with backoff, not forever off
            self.counts["missing_endpoint"] += 1
            self._missing_until = time.monotonic() + self._backoff_s
            self._set(f"no_decide_endpoint: HTTP {r.status_code}; retrying in {self._backoff_s:.0f}s")
            self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)
        else:
            self.counts["refused"] += 1
            self._set(f"refusing: HTTP {r.status_code}: {detail}")
        raise Unavailable(self.state)

    async def score(self, model: str, tokens: bytes, params: dict[str, str]) -> list[dict[str, Any]] | None:
        """`/score` rows (the fallback when the indexer does not decide); None if it did not answer.
        The holders' answer: a worker without a row holds nothing and has nothing in flight."""
        try:
            r = await self._call("POST", "/score", tokens, {"Content-Type": "application/octet-stream",
                                                            "Accept": "application/msgpack", **self.auth},
                                 self.timeout_s, {"model": model, "answer": "holders", **params})
        except _ERRORS as exc:
            self.counts["unreachable"] += 1
            self._set(f"unreachable: {type(exc).__name__}: {exc}".strip())
            return None
        if r.status_code == 404:
            return []
        if r.status_code != 200:
            self.counts["unauthorized" if r.status_code in (401, 403) else "refused"] += 1
            self._set(f"refusing: HTTP {r.status_code} on /score")
            return None
        try:
            return list(_plain.decode(r.content).get("workers", []))
        except (msgspec.DecodeError, AttributeError):
            return None

    # -- causal forwarding -----------------------------------------------------------------------
    async def wait(self, model: str, after: list[str], timeout_s: float) -> bool:
        """Wait until the worker admitted one of `after` (at most `timeout_s`); False: timed out."""
        ids = after[:MAX_WAIT_ROUTES]
        body = _mp.encode({"model": model, "request_ids": ids, "timeout_s": min(timeout_s, MAX_WAIT_S)})
        try:
            r = await self._call("POST", "/routes/wait", body, self._msgpack, timeout_s + self.timeout_s)
            left = _plain.decode(r.content)["waiting"] if r.status_code == 200 else ids
        except (*_ERRORS, msgspec.DecodeError, KeyError, TypeError):
            return False
        return len(set(left)) < len(set(ids))

    def admitted(self, model: str, request_id: str) -> None:
        """Queue the report that the worker admitted a route's request (its answer began): it rides on
        this router's next decision, or goes out within `admit_every_s` when none comes first (a
        waiter, here or at another router, waits that much longer at most)."""
        self._admits.setdefault(model, []).append(request_id)
        self._schedule(self.admit_every_s)

    @staticmethod
    def _take(queue: dict[str, list[str]], model: str) -> list[str]:
        ids = queue.pop(model, None)
        if not ids:
            return []
        if len(ids) > MAX_RELEASE:
            queue[model] = ids[MAX_RELEASE:]
            return ids[:MAX_RELEASE]
        return ids

    def _requeue(self, model: str, releases: list[str], admits: list[str]) -> None:
        if releases:
            self._releases.setdefault(model, []).extend(releases)
        if admits:
            self._admits.setdefault(model, []).extend(admits)
        if releases or admits:  # the timer that was armed for them may have fired meanwhile
            self._schedule(self.admit_every_s if admits else self.release_every_s)

    # -- releases, batched -------------------------------------------------------------------------
    def release(self, model: str, request_id: str) -> None:
        """Queue a route's release (no await: it happens however the response ended, cancelled too)."""
        ids = self._releases.setdefault(model, [])
        ids.append(request_id)
        self._schedule(0.0 if len(ids) >= 256 else self.release_every_s)

    def start(self) -> None:
        """Send what no decision carried in batches from now on (a timer armed only while reports wait:
        nothing runs while every report rides on a decision)."""
        self._started = True
        if self._admits or self._releases:
            self._schedule(0.0)

    def _schedule(self, delay_s: float) -> None:
        if not self._started:
            return
        loop = asyncio.get_running_loop()
        when = loop.time() + delay_s
        if self._timer is not None:
            if self._timer.when() <= when:
                return
            self._timer.cancel()
        self._timer = loop.call_at(when, self._due)

    def _due(self) -> None:
        self._timer = None
        if not (self._admits or self._releases):
            return
        if self._flushing is not None:  # the running batch arms the next one when it ends
            return
        self._flushing = asyncio.get_running_loop().create_task(self._flush_once())

    async def _flush_once(self) -> None:
        try:
            await self.flush()
        finally:
            self._flushing = None
            if self._admits:
                self._schedule(self.admit_every_s)
            elif self._releases:
                self._schedule(self.release_every_s)

    async def flush(self) -> None:
        """Send what no decision carried: admissions first (waiters may be held on them), releases."""
        admits, self._admits = self._admits, {}
        releases, self._releases = self._releases, {}
        for model in dict.fromkeys([*admits, *releases]):
            a, r = admits.get(model, []), releases.get(model, [])
            for i in range(0, max(len(a), len(r)), MAX_RELEASE):
                ca, cr = a[i:i + MAX_RELEASE], r[i:i + MAX_RELEASE]
                try:
                    resp = await self._call("POST", "/routes/release", _mp.encode(ReleaseRequest(cr, model, ca)),
                                            self._msgpack, self.timeout_s)
                    ok = resp.status_code == 200
                except _ERRORS:
                    ok = False
                if ok:
                    self.counts["released"] += len(cr)
                    self.counts["admitted"] += len(ca)
                else:  # the indexer's TTL forgets them (a waiter times out); counted, never retried forever
                    self.counts["release_failed"] += len(cr)
                    self.counts["admit_failed"] += len(ca)
                    self._warn("release", "event=route_release_failed routes=%d admissions=%d url=%s", len(cr),
                               len(ca), self.url)

    async def close(self) -> None:
        self._started = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._flushing is not None:
            try:
                await self._flushing
            except (asyncio.CancelledError, Exception):
                pass
        await self.flush()
        if self.raw is not None:
            self.raw.close()
