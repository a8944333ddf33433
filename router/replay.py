"""Trace replay through the OpenAI router (`kvatlas router --trace T --via URL`): each trace request
is sent at its arrival time (scaled by `speed`) to `POST {via}/v1/completions` as a token-id prompt,
so what is measured is what users deploy — the OpenAI router's tokenizer-free path, its one
`/routes/decide` round trip, its causal forwarding and releases. The record of each request comes
from the answer: the decision from `x-kvatlas-route`, what the worker served and its simulated
timeline from a `kvatlas worker`'s `x-kvatlas-served` / `x-kvatlas-ttft-s` / `x-kvatlas-queue-s`.

`kvatlas_arrival_s` (the trace's arrival, on the simulated clock the replicas share) travels in the
body, so the workers' virtual times do not depend on how loaded the machine is.

Lockstep (`--lockstep`, what `kvatlas demo` runs; docs/end-to-end.md "Lockstep"): one request at a
time in trace order, streamed, the next sent once this one's answer headers are back — the worker
sends them once it served the request, and they carry everything its record needs — and its body
drained meanwhile (a client that left would cancel it on the worker's timeline). `via` may then
name K routers (comma-separated): request i of the slice goes to the (i mod K)-th, so K replicas
take turns without coordinating with each other, and each decides with the fleet as every earlier
request, whichever replica sent it, left it.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import httpx
import msgspec

from sim.api import Tokens
from router.records import RequestRecord
from router.pacing import send_paced
from router.trace import TokenExpander, TraceRequest

_dec = msgspec.json.Decoder()


def parse_pairs(header: str, sep: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in header.split(sep):
        k, eq, v = part.strip().partition("=")
        if eq:
            out[k] = v
    return out


def _int(v: str | None) -> int | None:
    return int(v) if v is not None and v.isdigit() else None


def record_of(index: int, n_tokens: int, r: httpx.Response) -> RequestRecord:
    """A request's record from the router's and the worker's headers."""
    rec = RequestRecord(index=index, worker_id=r.headers.get("x-kvatlas-worker", ""), input_tokens=n_tokens)
    route = parse_pairs(r.headers.get("x-kvatlas-route", ""), ";")
    rec.predicted_cached = _int(route.get("predicted_cached_tokens"))
    pending = _int(route.get("predicted_pending_tokens"))
    if pending is not None:
        rec.predicted_pending = pending
    if r.status_code != 200:
        rec.error = f"HTTP {r.status_code}: {r.text[:200]}"
        return rec
    rec.arrival_cached = _int(r.headers.get("x-kvatlas-cached-tokens"))
    served = parse_pairs(r.headers.get("x-kvatlas-served", ""), ",")
    if served:
        rec.served = Tokens(**{k: int(v) for k, v in served.items() if k in ("gpu", "host", "disk", "shared",
                                                                               "computed")})
    for name, attr in (("x-kvatlas-ttft-s", "ttft_s"), ("x-kvatlas-queue-s", "queue_s")):
        v = r.headers.get(name)
        if v is not None:
            setattr(rec, attr, float(v))
    return rec


class OpenAIReplay:
    """Replays trace requests through one OpenAI router; `records` as the trace router keeps them."""

    def __init__(self, via: str, model: str, speed: float, timeout_s: float = 600.0, lockstep: bool = False) -> None:
        self.vias = [u.strip().rstrip("/") for u in via.split(",") if u.strip()]
        if not self.vias or (len(self.vias) > 1 and not lockstep):
            raise ValueError("--via names one router (several only with --lockstep)")
        self.via = self.vias[0]
        self.lockstep = lockstep
        self.model = model
        self.speed = speed
        # idle connections dropped before the router's server closes them (uvicorn: 5 s), so a request
        # is never sent on one in the instant it closes
        self.client = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=512,
                                                                               keepalive_expiry=2.0))
        self.records: list[RequestRecord] = []
        self.t0 = time.monotonic()

    async def close(self) -> None:
        await self.client.aclose()

    async def one(self, r: TraceRequest, tokens: list[int]) -> RequestRecord:
        body = {"model": self.model, "prompt": tokens, "max_tokens": r.output_length,
                "kvatlas_arrival_s": r.arrival_s}
        try:
            resp = await self.client.post(f"{self.via}/v1/completions", json=body)
            rec = record_of(r.index, len(tokens), resp)
        except httpx.HTTPError as exc:
            rec = RequestRecord(index=r.index, worker_id="", input_tokens=len(tokens), error=f"router: {exc!r}")
        self.records.append(rec)
        return rec

    async def replay(self, reqs: Sequence[TraceRequest], on_done: Callable[[int], None] | None = None,
                     start_at: float | None = None) -> list[RequestRecord]:
        expander = TokenExpander()
        self.t0 = time.monotonic() + (max(0.0, start_at - time.time()) if start_at is not None else 0.0)
        async def send(r: TraceRequest) -> None:
            await self.one(r, expander.tokens(r).tolist())

        if self.lockstep:
            await self._lockstep(reqs, expander, on_done)
        else:
            await send_paced(reqs, self.t0, self.speed, send, on_done)
        return self.records

    async def _lockstep(self, reqs: Sequence[TraceRequest], expander: TokenExpander,
                        on_done: Callable[[int], None] | None) -> None:
        done = 0

        async def drain(resp: httpx.Response, rec: RequestRecord) -> None:
            nonlocal done
            try:
                async for _ in resp.aiter_raw():
                    pass
            except httpx.HTTPError as exc:
                rec.error = rec.error or f"answer broke off: {exc!r}"
            finally:
                await resp.aclose()
            done += 1
            if on_done is not None:
                on_done(done)

        drains = []
        for i, r in enumerate(reqs):
            delay = self.t0 + r.arrival_s / self.speed - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing to the trace's clock (a lower bound: decisions are serial)
            tokens = expander.tokens(r).tolist()
            body = {"model": self.model, "prompt": tokens, "max_tokens": r.output_length, "stream": True,
                    "kvatlas_arrival_s": r.arrival_s}
            url = f"{self.vias[i % len(self.vias)]}/v1/completions"
            try:
                resp = await self.client.send(self.client.build_request("POST", url, json=body), stream=True)
            except httpx.HTTPError as exc:
                self.records.append(RequestRecord(index=r.index, worker_id="", input_tokens=len(tokens),
                                                  error=f"router: {exc!r}"))
                done += 1
                continue
            if resp.status_code != 200:
                await resp.aread()
            rec = record_of(r.index, len(tokens), resp)
            self.records.append(rec)
            drains.append(asyncio.create_task(drain(resp, rec)))
        await asyncio.gather(*drains)
