"""Lockstep: the OpenAI router deciding on the simulated clock (`kvatlas router --api openai
--lockstep`, in front of `kvatlas worker`s; docs/end-to-end.md, "Lockstep"). What `kvatlas demo`
runs so that every row repeats exactly: its replay sends one request at a time (the next once this
one's answer headers came back, i.e. once its worker served it), so the router's view of request i
is the fleet as requests 0..i-1 left it on the virtual clock, not as far as the machine got.

For a request with a virtual arrival (`kvatlas_arrival_s` in the body):

- each worker's load at that arrival, `GET /load?at=<arrival>&settle=true`: the worker first serves
  everything sent to it before, lands the copies and publishes the events (`Engine.barrier`), and
  names the last event batch's seq; the backlog is its timeline's, in virtual seconds;
- the index as those events left it: the router waits until the indexer applied that seq for every
  worker (`GET /workers/{id}`'s `last_seq`; a short poll, bounded by `wait_s`, counted when it
  runs out);
- this router's in-flight requests per worker at that arrival: those it sent whose simulated end
  (arrival + the worker's `x-kvatlas-e2e-s`) lies after it.

Routes are not reserved at the indexer in lockstep (every earlier request is served and visible
before the next decision: there is nothing in flight to bridge). Real engines keep the polled load
(router/proxy/load.py); a request without `kvatlas_arrival_s` is routed as without lockstep.
"""
from __future__ import annotations

import asyncio
import bisect
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx


class View:
    """What a lockstep decision reads: backlog (virtual seconds) and own in-flight, per worker."""

    __slots__ = ("at", "backlog", "inflight")

    def __init__(self, at: float, backlog: dict[str, float], inflight: dict[str, int]) -> None:
        self.at = at
        self.backlog = backlog
        self.inflight = inflight


def arrival_of(body: Mapping[str, Any]) -> float | None:
    at = body.get("kvatlas_arrival_s")
    if not isinstance(at, (int, float)) or isinstance(at, bool) or not math.isfinite(at) or at < 0:
        return None
    return float(at)


class Lockstep:
    def __init__(self, workers: Mapping[str, str], client: httpx.AsyncClient, indexer: str | None,
                 indexer_auth: Mapping[str, str] | None = None, wait_s: float = 10.0) -> None:
        self.workers = workers          # the router's own map (workers learned later included)
        self.client = client
        self.indexer = indexer.rstrip("/") if indexer else None
        self.auth = dict(indexer_auth or {})
        self.wait_s = wait_s
        self.ends: dict[str, list[float]] = {}  # per worker: simulated ends of this router's sends
        self.counts = {"views": 0, "event_wait_timeouts": 0, "load_failures": 0}

    def inflight(self, at: float, up: Sequence[str]) -> dict[str, int]:
        out = {}
        for w in up:
            e = self.ends.get(w, [])
            del e[:bisect.bisect_right(e, at)]  # ended: the replay's later arrivals come after `at`
            out[w] = len(e)
        return out

    async def _load(self, w: str, at: float) -> tuple[float, int | None]:
        r = await self.client.get(f"{self.workers[w]}/load", params={"at": repr(at), "settle": "true"})
        r.raise_for_status()
        d = r.json()
        return float(d["backlog_s"]), d.get("events_seq")

    async def _applied(self, w: str, seq: int) -> bool:
        """Until the indexer applied `seq` of worker `w` (False: not within `wait_s`)."""
        assert self.indexer is not None
        deadline = time.monotonic() + self.wait_s
        pause = 0.001
        while True:
            r = await self.client.get(f"{self.indexer}/workers/{w}", headers=self.auth)
            last = r.json().get("last_seq") if r.status_code == 200 else None
            if last is not None and last >= seq:
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(pause)  # a watermark poll: the indexer has no long poll for it
            pause = min(0.02, pause * 2)

    async def view(self, body: Mapping[str, Any], up: Sequence[str]) -> View | None:
        at = arrival_of(body)
        if at is None:
            return None
        self.counts["views"] += 1
        backlog: dict[str, float] = {}
        seqs: dict[str, int] = {}
        loads = await asyncio.gather(*(self._load(w, at) for w in up), return_exceptions=True)
        for w, got in zip(up, loads):
            if isinstance(got, BaseException):
                self.counts["load_failures"] += 1
                backlog[w] = 0.0
                continue
            backlog[w] = got[0]
            if got[1] is not None:
                seqs[w] = got[1]
        if self.indexer is not None and seqs:
            done = await asyncio.gather(*(self._applied(w, s) for w, s in seqs.items()))
            self.counts["event_wait_timeouts"] += sum(1 for ok in done if not ok)
        return View(at, backlog, self.inflight(at, up))

    def sent(self, worker: str, at: float, headers: Any) -> None:
        """The worker served a request that arrived at `at`: its simulated end counts it in flight."""
        e2e = headers.get("x-kvatlas-e2e-s")
        try:
            end = at + float(e2e)
        except (TypeError, ValueError):
            return
        bisect.insort(self.ends.setdefault(worker, []), end)
