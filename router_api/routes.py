"""The service's side of pending routes (indexer/pending.py): hashing a reported request into the
index's keys, confirming routes once the worker's own events cover them, forgetting routes of
workers that restarted, resynced or left, and the `pending_blocks` of `/score` rows
(docs/CONTRACTS.md, "Pending routes").

Causal forwarding: a route reported with `admits` names, in its answer, the routes its prediction
depends on that the worker has not admitted yet (`after`), by opaque handles (`route_handle`: route
ids are never handed to another client); their routers report admission (`admit`), and a waiter
(`watch`, on handles) is called once one of the routes it waits for no longer awaits admission.
Waits are bounded in number and in the routes they name, indexed by route (a change looks at the
waits on the routes it settled, not at every wait), and end at their deadline.

Every method but `keys` runs under the service's lock (it reads the index and the registry);
`now` is the service clock's value. No threads of its own: work happens when routes are reported,
admitted or released, when `/score` asks (a confirmation sweep within a budget of block keys), and
on `tick` (the service's timer: expiry and admission deadlines run without traffic); watchers'
callbacks run under the lock (they must only hand a wake-up to their own thread or loop).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from indexer.protocol import ScoringIndex
from indexer.pending import PendingRoutes
from router_api.metrics import RecentWindow

log = logging.getLogger("kvatlas.routes")


class UnknownRouteWorker(LookupError):
    """A route names a worker (or model) the registry does not know."""


class WaitsFull(RuntimeError):
    """The waits for admission already held are at their bound (HTTP 503)."""


class _Mark:
    """What a worker's stream looked like when its routes were last queued for confirmation: a
    changed seq means new events to check routes against; a changed epoch (restart, resync,
    re-registration) means its routes are void. `todo`: ids still to check (a bounded number per
    sweep, so a worker with many routes never costs one `/score` more than the budget)."""

    __slots__ = ("seq", "epoch", "todo")

    def __init__(self, seq: Any, epoch: tuple[int, int, float]) -> None:
        self.seq = seq
        self.epoch = epoch
        self.todo: list[str] = []


def _epoch(w: Any) -> tuple[int, int, float]:
    return (w.restarts, w.resyncs, w.registered_at)


class AdmissionCounts:
    """Causal forwarding's totals (the service exports them as counters)."""

    __slots__ = ("reported", "admitted", "dependent", "waits", "wait_timeouts", "wait_seconds", "waits_refused")

    def __init__(self) -> None:
        self.reported = 0       # routes added with `admits` (their routers report admission)
        self.admitted = 0       # admissions applied (a route awaiting it, here or from another replica)
        self.dependent = 0      # routes answered with a non-empty `after`
        self.waits = 0          # waits that had to block (a route in `after` still awaiting)
        self.wait_timeouts = 0  # of which ended by their deadline, some route still awaiting
        self.wait_seconds = 0.0  # their total time
        self.waits_refused = 0  # waits refused: the waits held were at their bound


class _Watch:
    __slots__ = ("model", "rids", "wake")

    def __init__(self, model: str, rids: tuple[str, ...], wake: Callable[[], None]) -> None:
        self.model = model
        self.rids = rids
        self.wake = wake


DEFAULT_MAX_WAITS = 4096            # waits for admission held at once (each names up to MAX_WAIT_ROUTES)
DEFAULT_MAX_WAIT_NAMES = 1 << 16    # route handles named by all of them together
SWEEP_BUDGET_KEYS = 4096            # block keys one sweep checks for confirmation (at least one route)


def route_handle(key: bytes, model: str, request_id: str) -> str:
    """The opaque name a route awaiting admission is given in other routes' `after`: a MAC of its model
    and id under the service's key (the route plane's secret under `--nats`, so every replica names it
    alike). It can be waited on (`/routes/wait`) and nothing else: it is not the route's id."""
    mac = hmac.new(key, model.encode() + b"\0" + request_id.encode(), hashlib.sha256).digest()
    return "h-" + base64.urlsafe_b64encode(mac[:18]).decode()


class RouteBook:
    __slots__ = ("pending", "visibility", "admission", "handle_key", "max_waits", "max_wait_names", "_marks",
                 "_watchers", "_watch_ids", "_by_route", "_due", "_wait_names")

    def __init__(self, pending: PendingRoutes | None = None, visibility: RecentWindow | None = None,
                 handle_key: bytes | None = None, max_waits: int = DEFAULT_MAX_WAITS,
                 max_wait_names: int = DEFAULT_MAX_WAIT_NAMES) -> None:
        self.pending = pending if pending is not None else PendingRoutes()
        # Publish time -> applied in the index (visible to /score), per batch with a timestamp (seconds;
        # the ingest loop adds them): what a route's pending entry bridges.
        self.visibility = visibility if visibility is not None else RecentWindow(4096)
        self.admission = AdmissionCounts()
        self.handle_key = handle_key if handle_key is not None else os.urandom(32)
        self.max_waits = max_waits
        self.max_wait_names = max_wait_names
        self._marks: dict[tuple[str, str], _Mark] = {}
        self._watchers: dict[int, _Watch] = {}
        self._watch_ids = itertools.count()
        self._by_route: dict[tuple[str, str], set[int]] = {}  # (model, id) -> waits on it
        self._due: list[tuple[str, str]] = []  # routes waited on that stopped awaiting admission
        self._wait_names = 0
        self.pending.on_settle = self._settled

    @staticmethod
    def keys(index: ScoringIndex, model: str, block_size: int, token_ids: Any, lora_name: str | None,
             cache_salt: str | None) -> list[int]:
        """The index's node keys of the request's full blocks (the same keys its stores get)."""
        return list(index.query_keys(model, token_ids, lora_name, cache_salt))

    # -- changes -------------------------------------------------------------------------------
    def report(self, index: ScoringIndex, registry: Any, model: str, request_id: str, worker_id: str, dp_rank: int,
               keys: Sequence[int], now: float, block_size: int, tokens: int | None = None,
               busy_until: float | None = None, admits: bool = False) -> tuple[int, int, int, list[str]]:
        """Add the route; returns (cached, pending, blocks, after): the worker's exact match of the
        request and the pending blocks past it before this route, the blocks the route holds, and the
        handles of the routes awaiting admission that hold the last pending block counted (the route
        must reach the worker after them; empty unless `admits`). The route's share of the worker's
        in-flight load is its `tokens` (the prompt's length; unknown: its full blocks) less what the
        worker holds or has pending of it now: the tokens it will prefill."""
        w = registry.get(worker_id)
        if w is None or w.reg.model != model:
            raise UnknownRouteWorker(f"worker {worker_id!r} is not registered for model {model!r}")
        self.pending.expire(now)
        mark = self._marks.get((model, worker_id))
        if mark is not None and mark.epoch != _epoch(w):  # restarted or resynced since: old routes are void
            self.forget_worker(model, worker_id)
            mark = None
        if mark is None:
            self._marks[(model, worker_id)] = _Mark(w.last_seq, _epoch(w))
        self.pending.discard(model, request_id)  # a re-reported id: its own earlier route is not ahead of it
        cached, hybrid = self._match(index, model, keys, (worker_id, dp_rank))
        pend = self.pending.run(model, worker_id, dp_rank, keys, cached, ends_only=hybrid)
        n = len(keys) * block_size if tokens is None else tokens
        prefill = max(0, n - (cached + pend) * block_size)
        after: list[str] = []
        if admits and pend:
            after = [r.handle for r in self.pending.blockers(model, worker_id, dp_rank, keys[cached + pend - 1])
                     if r.handle is not None]
            self.admission.dependent += bool(after)
        held = self.pending.add(model, request_id, worker_id, dp_rank, keys, now, prefill_tokens=prefill,
                                busy_until=busy_until, admits=admits,
                                handle=route_handle(self.handle_key, model, request_id) if admits else None)
        self.admission.reported += admits
        self._notify()
        return cached, pend, held, after

    @classmethod
    def _held(cls, index: ScoringIndex, model: str, keys: Sequence[int], pair: tuple[str, int]) -> int:
        """The exact match (any tier) of `keys` on one worker."""
        return cls._match(index, model, keys, pair)[0]

    @staticmethod
    def _match(index: ScoringIndex, model: str, keys: Sequence[int], pair: tuple[str, int]) -> tuple[int, bool]:
        """(exact match of `keys` on one worker, whether the model is hybrid: its rows carry kv_blocks)."""
        if not keys:
            return 0, False
        res = index.score_keys(model, list(keys), [pair])
        row = next((s for s in res.workers if s.worker_id == pair[0] and s.dp_rank == pair[1]), None)
        return (0, False) if row is None else (row.cached_blocks, row.kv_blocks is not None)

    def release(self, model: str, request_id: str, now: float) -> int:
        self.pending.expire(now)
        n = self.pending.release(model, request_id)
        self._notify()
        return n

    def admit(self, model: str, request_id: str) -> bool:
        """The worker accepted the route's request (its router saw the forward's response begin)."""
        ok = self.pending.admit(model, request_id)
        self.admission.admitted += ok
        self._notify()
        return ok

    def forget_worker(self, model: str, worker_id: str) -> None:
        self.pending.clear_worker(model, worker_id)
        self._marks.pop((model, worker_id), None)
        self._notify()

    def forget_model(self, model: str) -> None:
        """The model was dropped with its last worker: its routes go too."""
        self.pending.clear_model(model)
        for key in [k for k in self._marks if k[0] == model]:
            del self._marks[key]
        self._notify()

    def tick(self, index: Any, registry: Any, now: float) -> None:
        """What runs without traffic (the service's timer): expiry of routes and admission deadlines,
        which wakes their waiters, and a budgeted confirmation sweep of every model."""
        try:
            self.pending.expire(now)
            for model in list(index.models()):
                if self.pending.has(model):
                    self._sweep(index, registry, model, now)
        finally:
            self._notify()

    # -- waiting for admission -----------------------------------------------------------------
    def awaiting(self, model: str, handles: Sequence[str], now: float | None = None) -> list[str]:
        """Those of the handles that name a route of the model still awaiting admission (at `now`:
        expired ones and admission deadlines go first)."""
        if now is not None:
            self.pending.expire(now)
            self._notify()
        by_handle = self.pending.by_handle
        return [h for h in handles if (r := by_handle(h)) is not None and r.model == model]

    def watch(self, model: str, handles: Sequence[str], wake: Callable[[], None],
              now: float | None = None) -> int | None:
        """Call `wake` (once, under the lock) when one of the routes the handles name no longer awaits
        admission: admitted, past its admission deadline, released, confirmed, expired or cleared (any
        of `after` suffices: each holds every block the prediction counted). None (and no call): one
        of them does not await now. WaitsFull: the waits held are at their bound."""
        names = tuple(dict.fromkeys(handles))
        if not names or len(self.awaiting(model, names, now)) < len(names):
            return None
        if len(self._watchers) >= self.max_waits or self._wait_names + len(names) > self.max_wait_names:
            self.admission.waits_refused += 1
            raise WaitsFull(f"{len(self._watchers)} waits for admission are held (bound {self.max_waits}, "
                            f"{self.max_wait_names} routes named): retry later")
        rids = tuple(r.request_id for h in names if (r := self.pending.by_handle(h)) is not None)
        token = next(self._watch_ids)
        self._watchers[token] = _Watch(model, rids, wake)
        self._wait_names += len(rids)
        for rid in rids:
            self._by_route.setdefault((model, rid), set()).add(token)
        return token

    def unwatch(self, token: int | None) -> None:
        if token is None:
            return
        w = self._watchers.pop(token, None)
        if w is None:
            return
        self._wait_names -= len(w.rids)
        for rid in w.rids:
            key = (w.model, rid)
            tokens = self._by_route.get(key)
            if tokens is not None:
                tokens.discard(token)
                if not tokens:
                    del self._by_route[key]

    @property
    def waits(self) -> int:
        """Waits for admission held now."""
        return len(self._watchers)

    def waited(self, seconds: float, timed_out: bool) -> None:
        """A wait that blocked ended (its endpoint measures it)."""
        self.admission.waits += 1
        self.admission.wait_timeouts += timed_out
        self.admission.wait_seconds += seconds

    def _settled(self, model: str, request_id: str) -> None:
        if (model, request_id) in self._by_route:
            self._due.append((model, request_id))

    def _notify(self) -> None:
        """Wake the waits on routes that stopped awaiting admission since: only theirs are looked at."""
        while self._due:
            key = self._due.pop()
            for token in list(self._by_route.get(key, ())):
                w = self._watchers.get(token)
                self.unwatch(token)
                if w is not None:
                    w.wake()

    # -- scoring -------------------------------------------------------------------------------
    def sweep(self, index: Any, registry: Any, model: str, now: float) -> None:
        """Expire; forget routes of workers gone or restarted/resynced; confirm routes whose blocks
        the worker's events now cover (checked only for workers with new events since last time)."""
        try:
            self._sweep(index, registry, model, now)
        finally:
            self._notify()

    def _sweep(self, index: Any, registry: Any, model: str, now: float, budget: int = SWEEP_BUDGET_KEYS) -> None:
        pend = self.pending
        pend.expire(now)
        if not pend.has(model):
            return
        for wid in pend.workers(model):
            w = registry.get(wid)
            mark = self._marks.get((model, wid))
            if w is None or w.reg.model != model or (mark is not None and mark.epoch != _epoch(w)):
                self.forget_worker(model, wid)
                continue
            if mark is None:
                mark = self._marks[(model, wid)] = _Mark(None, _epoch(w))
            if not mark.todo:
                if mark.seq == w.last_seq:
                    continue
                mark.seq = w.last_seq  # new events: its routes are checked against them, a budget at a time
                mark.todo = pend.worker_routes(model, wid)[::-1]
            while mark.todo and budget > 0:
                r = pend.get(model, mark.todo.pop())
                if r is None or r.pair[0] != wid:
                    continue
                budget -= len(r.keys) + 1
                if r.keys and self._held(index, model, r.keys, r.pair) >= len(r.keys):
                    pend.confirm(model, r.request_id)
            if budget <= 0:
                return

    def pending_run(self, model: str, worker_id: str, dp_rank: int, keys: Sequence[int], exact: int,
                    hybrid: bool = False) -> int:
        """`pending_blocks` of one row: leading query blocks past the exact match `exact` that are
        pending on that worker (a hybrid model's: up to where a route ends, indexer/pending.py)."""
        return self.pending.run(model, worker_id, dp_rank, keys, exact, ends_only=hybrid)

    def load(self, model: str, worker_id: str, dp_rank: int, now: float) -> tuple[int, int, float | None]:
        """(`pending_requests`, `pending_prefill_tokens`, `busy_until`) of one row: the in-flight routes to
        that worker and rank not yet confirmed, released or expired, the tokens they will prefill, and the
        largest end time routers reported with their routes there (indexer/pending.py)."""
        ld = self.pending.load(model, worker_id, dp_rank)
        busy = self.pending.busy_until(model, worker_id, dp_rank, now)
        return (0, 0, busy) if ld is None else (ld.requests, ld.prefill_tokens, busy)

    # -- metrics -------------------------------------------------------------------------------
    def metrics_text(self) -> str:
        p = "kvatlas_pending_"
        lines = [f"# HELP {p}routes_total In-flight routes by outcome (added, released, confirmed by the "
                 "worker's events, expired by TTL, dropped over the cap, cleared with their worker)",
                 f"# TYPE {p}routes_total counter"]
        lines += [f'{p}routes_total{{outcome="{k}"}} {v}' for k, v in self.pending.counts.items()]
        a = self.admission
        lines += [f"# HELP {p}admission_total Causal forwarding: routes reported with admission tracking, "
                  "admissions applied, routes answered with routes to follow (after), waits that blocked and "
                  "of them those that timed out",
                  f"# TYPE {p}admission_total counter"]
        lines += [f'{p}admission_total{{what="{k}"}} {getattr(a, k)}'
                  for k in ("reported", "admitted", "dependent", "waits", "wait_timeouts", "waits_refused")]
        lines += [f'{p}admission_total{{what="deadline_passed"}} {self.pending.admission_expired}',
                  f"# HELP {p}busy_until_refused_total busy_until values not kept (not finite or out of range)",
                  f"# TYPE {p}busy_until_refused_total counter",
                  f"{p}busy_until_refused_total {self.pending.busy_refused}"]
        lines += [f"# HELP {p}admission_wait_seconds_total Time waits for admission blocked",
                  f"# TYPE {p}admission_wait_seconds_total counter",
                  f"{p}admission_wait_seconds_total {a.wait_seconds:.6f}",
                  f"# HELP {p}admission_waiting Waits for admission blocked now", f"# TYPE {p}admission_waiting gauge",
                  f"{p}admission_waiting {len(self._watchers)}",
                  f"# HELP {p}admission_waiting_routes Route handles the blocked waits name now",
                  f"# TYPE {p}admission_waiting_routes gauge", f"{p}admission_waiting_routes {self._wait_names}"]
        lines += [f"# HELP {p}routes In-flight routes held now", f"# TYPE {p}routes gauge",
                  f"{p}routes {len(self.pending)}",
                  f"# HELP {p}blocks Block keys held by in-flight routes now", f"# TYPE {p}blocks gauge",
                  f"{p}blocks {self.pending.blocks}"]
        q = self.visibility.quantiles((0.5, 0.99))
        name = "kvatlas_event_visibility_seconds"
        lines += [f"# HELP {name} Publish to applied-in-the-index time of recent batches (quantiles)",
                  f"# TYPE {name} gauge"]
        lines += [f'{name}{{quantile="{k}"}} {v:.6f}' for k, v in zip(("0.5", "0.99"), q) if v is not None]
        return "\n".join(lines) + "\n"

    def stats(self) -> dict[str, Any]:
        p50, p99 = self.visibility.quantiles((0.5, 0.99))
        a = self.admission
        return {"routes": len(self.pending), "blocks": self.pending.blocks,
                "outcomes": dict(self.pending.counts.items()),
                "admission": {**{k: getattr(a, k) for k in a.__slots__}, "waiting": len(self._watchers),
                              "deadline_passed": self.pending.admission_expired},
                "visibility": {"count": len(self.visibility),
                               "p50_ms": None if p50 is None else p50 * 1e3,
                               "p99_ms": None if p99 is None else p99 * 1e3}}


class RouteTimer:
    """The shell that runs `RouteBook.tick` every `interval_s` under the service's lock, so routes
    expire, admission deadlines pass (waking their waiters) and confirmations happen with no
    traffic at all. Idle (nothing pending, no wait held) it takes no lock."""

    __slots__ = ("book", "lock", "index", "registry", "clock", "interval_s", "_stop", "_thread")

    def __init__(self, book: RouteBook, lock: Any, index: Any, registry: Any, clock: Callable[[], float],
                 interval_s: float = 0.1) -> None:
        self.book = book
        self.lock = lock
        self.index = index
        self.registry = registry
        self.clock = clock
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvatlas-routes", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        book = self.book
        while not self._stop.wait(self.interval_s):  # a period, not a synchronisation
            if not (len(book.pending) or book.pending.active_any() or book.waits):
                continue
            try:
                with self.lock:
                    book.tick(self.index, self.registry, self.clock())
            except Exception as exc:  # the next tick tries again; never kill the timer
                log.error("event=route_tick_failed error=%r", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
