"""Worker load from the engines' own Prometheus `/metrics` (docs/openai.md, "Worker load"), and the
per-worker up/down state the proxy routes on.

`parse_load` is pure: vLLM's `vllm:num_requests_running` / `vllm:num_requests_waiting` /
`vllm:kv_cache_usage_perc` (older: `vllm:gpu_cache_usage_perc`) or SGLang's `sglang:num_running_reqs`
/ `sglang:num_queue_reqs` / `sglang:token_usage`, summed over label sets (data-parallel engines
report one series per rank). `LoadPoller` polls each worker on its own interval; a worker whose
metrics cannot be read (refused, past the deadline, too large, non-200, unparsable) is marked down
and skipped, with one log line per change of state, never a crash or a wait.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Callable

import httpx

log = logging.getLogger("kvatlas.router")

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_KNOWN = frozenset(RUNNING + WAITING + KV_USAGE)


class WorkerLoad:
    """One reading: requests running / waiting and KV usage (0..1); None where the engine reports none."""

    __slots__ = ("running", "waiting", "kv_usage", "engine")

    def __init__(self, running: float | None = None, waiting: float | None = None, kv_usage: float | None = None,
                 engine: str = "unknown") -> None:
        self.running = running
        self.waiting = waiting
        self.kv_usage = kv_usage
        self.engine = engine  # "vllm" | "sglang" | "unknown" (metrics without either's names)


def parse_load(text: str) -> WorkerLoad:
    """The load in a Prometheus text exposition; series this does not know are ignored. Malformed
    lines are skipped (one bad line must not hide the load)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        name = line[:brace] if 0 <= brace < space else line[:space]
        if name not in _KNOWN:
            continue
        value_part = line[line.rfind("}") + 1:] if brace >= 0 else line[space:]
        try:
            value = float(value_part.split()[0])
        except (ValueError, IndexError):
            continue
        if math.isnan(value):
            continue
        sums[name] = sums.get(name, 0.0) + value

    def first(names: tuple[str, ...]) -> float | None:
        return next((sums[n] for n in names if n in sums), None)

    engine = "vllm" if any(n.startswith("vllm:") for n in sums) else \
        "sglang" if any(n.startswith("sglang:") for n in sums) else "unknown"
    return WorkerLoad(first(RUNNING), first(WAITING), first(KV_USAGE), engine)


class WorkerState:
    __slots__ = ("worker_id", "url", "up", "reason", "load", "last_ok", "checks", "failures")

    def __init__(self, worker_id: str, url: str) -> None:
        self.worker_id = worker_id
        self.url = url
        self.up: bool | None = None  # None: not polled yet
        self.reason = "not polled yet"
        self.load = WorkerLoad()
        self.last_ok: float | None = None
        self.checks = 0
        self.failures = 0


class LoadPoller:
    """Polls `GET {url}/metrics` of every worker every `interval_s`, each worker on its own schedule
    (a slow one never delays the others' readings); one poll has a total deadline (`timeout_s`,
    headers and body together: a server that drips bytes is cut off) and a size cap (`max_bytes`).
    `mark_down` lets the forwarder report a connection failure at once (the next successful poll
    brings the worker back)."""

    def __init__(self, workers: dict[str, str], client: httpx.AsyncClient, *, interval_s: float = 1.0,
                 timeout_s: float = 2.0, max_bytes: int = 4 * 1024 * 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError("the metrics poll interval must be positive")
        self.states = {w: WorkerState(w, u) for w, u in workers.items()}
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._running = False
        self._warned_unknown: set[str] = set()

    def _set(self, st: WorkerState, up: bool, reason: str) -> None:
        if st.up is not up:
            if up:
                log.info("event=worker_up worker=%s url=%s engine=%s", st.worker_id, st.url, st.load.engine)
            else:
                log.warning("event=worker_down worker=%s url=%s reason=%s (skipped until its /metrics answers)",
                            st.worker_id, st.url, reason)
        st.up = up
        st.reason = reason

    def mark_down(self, worker_id: str, reason: str) -> None:
        self._set(self.states[worker_id], False, reason)

    async def _fetch(self, url: str) -> tuple[int, bytes]:
        """(status, body) of one GET, the body cut off past `max_bytes` (ValueError)."""
        async with self.client.stream("GET", f"{url}/metrics", timeout=self.timeout_s) as r:
            if r.status_code != 200:
                return r.status_code, b""
            chunks: list[bytes] = []
            size = 0
            async for chunk in r.aiter_bytes():
                size += len(chunk)
                if size > self.max_bytes:
                    raise ValueError(f"metrics larger than {self.max_bytes} bytes")
                chunks.append(chunk)
            return 200, b"".join(chunks)

    async def poll_one(self, st: WorkerState) -> None:
        st.checks += 1
        try:
            status, body = await asyncio.wait_for(self._fetch(st.url), self.timeout_s)
        except asyncio.TimeoutError:
            st.failures += 1
            self._set(st, False, f"metrics took longer than {self.timeout_s:g}s")
            return
        except ValueError as exc:
            st.failures += 1
            self._set(st, False, f"metrics refused: {exc}")
            return
        except httpx.HTTPError as exc:
            st.failures += 1
            self._set(st, False, f"metrics unreachable: {type(exc).__name__}: {exc}".strip())
            return
        if status != 200:
            st.failures += 1
            self._set(st, False, f"metrics answered HTTP {status}")
            return
        try:
            st.load = parse_load(body.decode("utf-8", "replace"))
        except Exception as exc:  # a body this parser has never seen: the worker is skipped, not the router
            st.failures += 1
            self._set(st, False, f"metrics unreadable: {type(exc).__name__}: {exc}")
            return
        if st.load.engine == "unknown" and st.worker_id not in self._warned_unknown:
            self._warned_unknown.add(st.worker_id)
            log.warning("event=worker_load_unknown worker=%s url=%s detail=no vLLM or SGLang load series in "
                        "/metrics; routed on cache and this router's own in-flight count", st.worker_id, st.url)
        st.last_ok = self.clock()
        self._set(st, True, "ok")

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll_one(st) for st in self.states.values()))

    async def _loop(self, st: WorkerState) -> None:
        while True:
            await asyncio.sleep(self.interval_s)  # the poll period (load is a metric, not a lock)
            try:
                await self.poll_one(st)
            except Exception:  # never let the poller die silently
                log.exception("event=load_poll_failed worker=%s", st.worker_id)

    def add(self, worker_id: str, url: str) -> None:
        st = self.states.get(worker_id)
        if st is not None and st.url == url:
            return
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
        st = self.states[worker_id] = WorkerState(worker_id, url)
        if self._running:
            loop = asyncio.get_running_loop()
            loop.create_task(self.poll_one(st))
            self._tasks[worker_id] = loop.create_task(self._loop(st))

    def start(self) -> None:
        if not self._running:
            self._running = True
            loop = asyncio.get_running_loop()
            for w, st in self.states.items():
                self._tasks[w] = loop.create_task(self._loop(st))

    async def close(self) -> None:
        self._running = False
        tasks, self._tasks = list(self._tasks.values()), {}
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass

    def up(self) -> list[str]:
        return [w for w, st in self.states.items() if st.up]
