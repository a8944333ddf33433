"""The worker's engine thread: owns the `TieredCache` (every cache call happens here, as on an
engine's scheduler thread), serves requests one at a time in arrival order, and steps the cache
between requests so copy acks land and events go out (docs/end-to-end.md, "The worker").

Serving a request: match at arrival (the engine-side truth the router's prediction is checked
against) → L3 prefetch and wait for it → host→GPU load-back → allocate and "compute" the rest
(content-derived bytes into real torch pages) → insert → step. Times are the simulated model's.
"""
from __future__ import annotations

import heapq
import logging
import math
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from producer.allocator import PoolExhausted
from sim.driver import write_pattern
from sim.hybrid import insert_request
from producer.cache import TieredCache
from producer.components.swa import SlidingWindowComponent
from producer.storage.keys import page_key
from sim.schedule import QueueFull, Schedule, Slot
from schemas.media import Medium
from sim.api import SimModel, Tokens

log = logging.getLogger(__name__)


class Served:
    """What one request got from the cache and the timeline."""

    __slots__ = ("arrival_cached", "tokens", "queue_s", "load_s", "prefill_s", "ttft_s", "e2e_s", "slot")

    def __init__(self, arrival_cached: int, tokens: Tokens, queue_s: float, load_s: float,
                 prefill_s: float, ttft_s: float, e2e_s: float, slot: Slot | None = None) -> None:
        self.arrival_cached = arrival_cached
        self.tokens = tokens
        self.queue_s = queue_s
        self.load_s = load_s
        self.prefill_s = prefill_s
        self.ttft_s = ttft_s
        self.e2e_s = e2e_s
        self.slot = slot  # its place on the timeline (`Engine.cancel`)


class _Job:
    __slots__ = ("tokens", "max_tokens", "arrival", "fut")

    def __init__(self, tokens: list[int] | None, max_tokens: int, arrival: float, fut: Future[Any]) -> None:
        self.tokens = tokens
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.fut = fut


class Engine:
    """Single-threaded owner of the cache; `submit` is safe from any thread."""

    def __init__(self, cache: TieredCache, sim: SimModel, *, probe: Any = None,
                 prefetch_wait_s: float = 2.0, idle_step_s: float = 0.005, chunk_pages: int = 8,
                 running_state_share: float = 0.0, settle_s: float = 5.0) -> None:
        self.cache = cache
        self.settle_s = settle_s  # wall seconds a request waits for the copies before it (_settle)
        self.sim = sim
        self.chunk_pages = chunk_pages  # hybrid: a Mamba state at every prefill chunk's end (sim.hybrid)
        if not 0.0 <= running_state_share < 1.0:
            raise ValueError("running_state_share must be in [0, 1)")
        # Mamba: the share of the GPU state pool a full batch of running requests holds (their working
        # states), taken from the states the cache keeps (`_hold_running_states`)
        self.running_state_share = running_state_share
        self._state_pool = next((c for c in cache.components if not c.per_page), None)
        self._held: list[int] = []
        self.schedule = Schedule(sim)
        self.probe = probe  # a second handle on a shared L3 store: arrival truth includes it
        self.prefetch_wait_s = prefetch_wait_s
        self.idle_step_s = idle_step_s
        self.lock = threading.Lock()  # guards `schedule` for /load readers
        self.counts = {"requests": 0, "rejected": 0, "no_memory": 0, "no_component_memory": 0, "errors": 0}
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._seq = 0  # submissions taken off the queue: the tie-break of equal arrivals
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # -- thread-safe API ---------------------------------------------------------------------
    def cancel(self, served: Served, at: float) -> bool:
        """The client of a served request disconnected at virtual time `at`: free what it had not used
        yet on the timeline (`Schedule.cancel`). True when something was freed."""
        if served.slot is None:
            return False
        with self.lock:
            freed = self.schedule.cancel(served.slot, at)
        if freed:
            self.counts["cancelled"] = self.counts.get("cancelled", 0) + 1
        return freed

    def submit(self, tokens: Sequence[int], max_tokens: int, arrival_s: float) -> Future[Served]:
        fut: Future[Served] = Future()
        self._jobs.put(_Job(list(tokens), max_tokens, arrival_s, fut))
        return fut

    def barrier(self) -> Future[None]:
        """Done once the engine has served every request handed to it before this call and their
        copies have landed and their events gone to the sink (`_settle`): a load read after it
        (`load(at)`) includes them all, and so do the events, whatever the wall clock did meanwhile.
        A router that decides on the virtual clock reads the load of a worker through this, not from
        a poll (docs/end-to-end.md, "Lockstep")."""
        fut: Future[None] = Future()
        self._jobs.put(_Job(None, 0, math.inf, fut))  # sorts after every real arrival
        return fut

    def full(self, arrival_s: float) -> bool:
        """`max_queue` requests already wait at that time: a submission now would be refused."""
        with self.lock:
            return self.schedule.queued_at(arrival_s) >= self.sim.max_queue

    def load(self, at: float | None) -> tuple[float, int, int, float, float]:
        with self.lock:
            s = self.schedule
            t = s.last_arrival if at is None else at
            return t, s.queued_at(t), s.running_at(t), s.backlog_at(t), s.free_at()

    def pages(self) -> tuple[dict[str, int], dict[str, int]]:
        c = self.cache
        free = {"gpu": c.device.allocator.available}
        total = {"gpu": c.device.num_pages}
        if c.host is not None:
            free["host"] = c.host.allocator.available
            total["host"] = c.host.num_pages
        return free, total

    def close(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._jobs.put(None)
        self._thread.join(timeout)

    # -- engine thread -----------------------------------------------------------------------
    def _next_job(self, ready: list[tuple[float, int, _Job]]) -> _Job | None:
        """The next job to serve: of those submitted so far, the earliest on the virtual clock (ties in
        submission order). Requests that reached the engine late (after later arrivals) overtake the
        later ones still waiting, so the timeline and the cache see them in arrival order however the
        wall clock delivered them. None: stop."""
        while True:
            try:
                job = self._jobs.get_nowait() if ready else self._jobs.get(timeout=self.idle_step_s)
            except queue.Empty:
                if ready:
                    return heapq.heappop(ready)[2]
                self.cache.step()  # land acks, publish their events, heartbeat
                if self._stop:
                    return None
                continue
            if job is None:
                return None
            self._seq += 1
            heapq.heappush(ready, (job.arrival, self._seq, job))

    def _run(self) -> None:
        cache = self.cache
        ready: list[tuple[float, int, _Job]] = []
        while not self._stop:
            job = self._next_job(ready)
            if job is None:
                break
            tokens, max_tokens, arrival, fut = job.tokens, job.max_tokens, job.arrival, job.fut
            if not fut.set_running_or_notify_cancel():
                continue
            if tokens is None:  # a barrier: everything handed over before it is served
                self._settle()
                fut.set_result(None)
                continue
            try:
                fut.set_result(self._serve(tokens, max_tokens, arrival))
            except QueueFull as exc:
                self.counts["rejected"] += 1
                fut.set_exception(exc)
            except Exception as exc:  # a bad request must not kill the engine
                self.counts["errors"] += 1
                log.exception("request failed")
                fut.set_exception(exc)
        for *_, left in ready:  # stopped with requests still waiting: their callers are told
            left.fut.cancel()
        try:
            cache.wait_transfers(5.0)
        except TimeoutError:
            log.warning("copies still in flight at shutdown")
        cache.step()

    def _shared_run(self, tokens: list[int], have_pages: int) -> int:
        """Leading pages after `have_pages` the shared store holds (pages another worker backed up)."""
        p = self.cache.page_size
        npages = len(tokens) // p
        # a hybrid prefix is usable only with its components: KV keys in the store do not tell that
        if self.probe is None or have_pages >= npages or self.cache.hybrid:
            return 0
        digests = self.cache.tree.chain(tokens[:npages * p], p)
        keys = [page_key(d, self.cache.config.storage_suffix) for d in digests[have_pages:]]
        n = 0
        for ok in self.probe.exists(keys):
            if not ok:
                break
            n += 1
        return n

    def _serve(self, tokens: list[int], max_tokens: int, arrival: float) -> Served:
        cache, sim = self.cache, self.sim
        p = cache.page_size
        npages = len(tokens) // p
        with self.lock:  # fail fast before touching the cache
            if self.schedule.queued_at(arrival) >= sim.max_queue:
                raise QueueFull(f"{sim.max_queue} requests already waiting")
        self._hold_running_states(arrival)
        self._settle()
        m = cache.match_prefix(tokens)
        arrival_cached = m.best_len + p * self._shared_run(tokens, m.best_len // p)
        near = m.device_len + m.host_len
        # hybrid: the KV on the GPU, usable or not (a component missing there is loaded on its own)
        kv_gpu = max(m.device_len, m.kv_len)
        before = (cache.stats.get("prefetch_landed_pages", 0), cache.stats.get("prefetch_component_states", 0))
        if cache.storage is not None and cache.prefetch(tokens, m):
            cache.storage.wait_idle(self.prefetch_wait_s)
            cache.step()
            m = cache.match_prefix(tokens)
        l3 = max(0, m.device_len + m.host_len - near)
        comp_l3 = False
        if cache.hybrid:  # KV from L3 = the pages the prefetch landed (it may bring components alone)
            l3 = p * (cache.stats.get("prefetch_landed_pages", 0) - before[0])
            comp_l3 = cache.stats.get("prefetch_component_states", 0) > before[1]
        device_usable = m.device_len
        pages, node = m.device_pages, m.device_node
        if m.host_len:
            pages, node = cache.init_load_back(m)
        used = len(pages) * p
        gpu = min(kv_gpu if cache.hybrid else m.device_len, used)
        host = min(max(0, m.host_len - l3), used - gpu) if not cache.hybrid else max(0, used - gpu - l3)
        l3 = used - gpu - host
        shared = cache.l3_medium == Medium.EXTERNAL
        got = Tokens(gpu=gpu, host=host, disk=0 if shared else l3, shared=l3 if shared else 0,
                     computed=len(tokens) - used)
        cache.lock(node)  # type: ignore[arg-type]
        try:
            new = self._alloc(npages - len(pages))
            if new is None:
                self.counts["no_memory"] += 1  # computed, but nothing new is cached
            else:
                if new:
                    digests = cache.tree.chain(tokens[:npages * p], p)
                    for page, d in zip(new, digests[len(pages):]):
                        write_pattern(cache.device, page, d)
                if not insert_request(cache, tokens, pages + new, len(pages), self.chunk_pages,
                                      m.branch_len // p):
                    self.counts["no_component_memory"] += 1
        finally:
            cache.unlock(node)  # type: ignore[arg-type]
        cache.step()
        load_s = sim.load_s(got.host, got.disk, got.shared)
        if used > device_usable:  # the prefix's end is not usable on the GPU alone: its components move
            tier = ("shared" if shared else "disk") if (comp_l3 or l3) else "host"
            load_s += self._component_load_s(tier, used - device_usable)
        prefill_s = sim.prefill_s(got.computed)
        with self.lock:
            slot = self.schedule.admit(arrival, load_s, prefill_s, max_tokens)
        self.counts["requests"] += 1
        return Served(arrival_cached, got, slot.start - arrival, load_s, prefill_s,
                      slot.first - arrival, slot.finish - arrival, slot)

    def _settle(self) -> None:
        """Land the copies and L3 writes of the requests served before this one. They take milliseconds
        and requests are virtual seconds apart; without the wait, the tier a block is found in (and
        so this request's load-back and what a GPU eviction may take) would depend on how fast this
        machine's copy threads ran, not only on the requests before it."""
        cache = self.cache
        try:
            cache.wait_transfers(self.settle_s)
        except TimeoutError:
            self.counts["settle_timeouts"] = self.counts.get("settle_timeouts", 0) + 1
        cache.step()
        if cache.storage is not None and not cache.storage.wait_idle(self.settle_s):
            self.counts["settle_timeouts"] = self.counts.get("settle_timeouts", 0) + 1
        cache.step()

    def _hold_running_states(self, arrival: float) -> None:
        """Running requests' working Mamba states come from the pool the cache keeps its states in
        (SGLang's HybridReqToTokenPool: one working slot and two tracking slots per running request,
        running requests capped at a fifth of the pool, so a full batch holds 3/5 of it). Hold that
        share for the requests running at `arrival`: the cache's LRU states make room (tombstoned,
        their KV stays); states in use or in flight are never taken, so the hold may fall short."""
        c = self._state_pool
        if c is None or not self.running_state_share:
            return
        with self.lock:
            running = min(self.schedule.running_at(arrival), self.sim.max_batch)
        want = int(self.running_state_share * c.device.allocator.num_pages * running / self.sim.max_batch)
        held = self._held
        if len(held) > want:
            c.device.free(held[want:])
            del held[want:]
            return
        short = want - len(held)
        if short > c.device.allocator.available:
            self.cache.evict_component(c.name, short - c.device.allocator.available)
        n = min(short, c.device.allocator.available)
        if n:
            held.extend(c.device.alloc(n))

    def _component_load_s(self, tier: str, below: int) -> float:
        """Load-back of a hybrid prefix's components, `below` tokens of its end not usable on the GPU
        alone: the Mamba state at its end and the window's pages, from `tier` (host, disk, shared:
        the deepest tier they came from)."""
        if below <= 0 or not self.cache.components:
            return 0.0
        sim, p = self.sim, self.cache.page_size
        nbytes = 0
        for c in self.cache.components:
            if isinstance(c, SlidingWindowComponent):
                nbytes += min(below, c.need * p) * sim.window_bytes_per_token
            elif not c.per_page:
                nbytes += sim.mamba_state_bytes
        return sim.load_bytes_s(nbytes, tier)

    def _alloc(self, n: int) -> list[int] | None:
        cache = self.cache
        for attempt in range(4):
            try:
                return cache.alloc_device(n)
            except PoolExhausted:
                if attempt == 3:
                    return None
                cache.wait_transfers(5.0)  # pages pinned by in-flight copies come free when they land
                cache.step()
        return None


class VirtualClock:
    """Virtual seconds since creation at `speed` virtual seconds per wall second."""

    __slots__ = ("speed", "t0")

    def __init__(self, speed: float) -> None:
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.speed = speed
        self.t0 = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self.t0) * self.speed
