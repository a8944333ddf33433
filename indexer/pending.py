"""In-flight ("pending") routes: blocks a router has sent to a worker that the worker has not yet
reported storing (docs/CONTRACTS.md, "Pending routes").

A router that chose worker W for a request reports it; until W's own store events cover the
request's blocks (exact residency takes over), the route is released, or its TTL passes, those
blocks count as *pending* on W. Scoring asks `run` how many of a query's leading blocks, past the
exact match, are pending on a worker. Pending state never touches the exact index: it is a
separate structure the scoring path consults.

A plain data structure: no clock (callers pass `now`), no threads, no I/O. Keys are the index's own
node keys (`indexer.hashing.query_keys`), so a pending block and a stored block of the same content
and namespace are the same key.

Everything here came from another party (routers, other replicas), so every structure is bounded
(routes and blocks overall and per (worker, dp_rank), so one flooded worker cannot push out the
routes of the others), expires by `now` (routes by their TTL, admission by its deadline), and
`busy_until` values are kept only while their route is (a non-finite or out-of-range one is not kept).
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Sequence

DEFAULT_TTL_S = 10.0             # a route not released or confirmed by then is forgotten
DEFAULT_MAX_ROUTES = 65_536      # entries over all models; the oldest are dropped beyond it
DEFAULT_MAX_BLOCKS = 1 << 20     # block keys over all entries; the oldest are dropped beyond it
DEFAULT_MAX_PAIR_ROUTES = 4_096  # entries to one (worker, dp_rank); its oldest are dropped beyond it
DEFAULT_MAX_PAIR_BLOCKS = 1 << 18  # block keys of one (worker, dp_rank)'s entries; likewise
DEFAULT_ADMIT_TIMEOUT_S = 1.0    # a route whose admission is not reported by then no longer awaits it
BUSY_LIMIT = 1e12                # |busy_until| kept (the HTTP schema's bound); beyond, or not finite: ignored

Pair = tuple[str, int]  # (worker_id, dp_rank)


class PendingRoute:
    __slots__ = ("model", "request_id", "pair", "keys", "expires_at", "gen", "prefill", "awaiting", "handle")

    def __init__(self, model: str, request_id: str, pair: Pair, keys: tuple[int, ...], expires_at: float,
                 gen: int, prefill: int = 0, awaiting: bool = False, handle: str | None = None) -> None:
        self.model = model
        self.request_id = request_id
        self.pair = pair
        self.keys = keys
        self.expires_at = expires_at
        self.gen = gen  # distinguishes a re-reported id from its earlier entry in the expiry heap
        self.prefill = prefill  # tokens the worker will compute for it (not cached nor pending when reported)
        self.awaiting = awaiting  # its router will report the worker's admission of it, not done yet
        self.handle = handle  # what others may wait on while it awaits admission (never its id)


class PairLoad:
    """In-flight load of one (worker, dp_rank) from its pending routes: every router replica's."""

    __slots__ = ("requests", "prefill_tokens", "blocks", "routes")

    def __init__(self) -> None:
        self.requests = 0
        self.prefill_tokens = 0
        self.blocks = 0
        self.routes: dict[str, PendingRoute] = {}  # request_id -> route, oldest first


class _Busy:
    __slots__ = ("value", "expires", "gen")

    def __init__(self, value: float, expires: float, gen: int) -> None:
        self.value = value
        self.expires = expires
        self.gen = gen


class _PairBusy:
    """The `busy_until` values of a pair's routes (request_id -> value, oldest first) and a lazy
    max-heap over them: its top is popped while it names a value no longer held."""

    __slots__ = ("values", "heap")

    def __init__(self) -> None:
        self.values: dict[str, _Busy] = {}
        self.heap: list[tuple[float, int, str]] = []  # (-value, gen, request_id)

    def top(self, now: float) -> float | None:
        heap, values = self.heap, self.values
        while heap:
            neg, gen, rid = heap[0]
            b = values.get(rid)
            if b is not None and b.gen == gen and b.expires > now:
                return -neg
            heapq.heappop(heap)
        return None

    def put(self, rid: str, b: _Busy) -> None:
        self.values.pop(rid, None)
        self.values[rid] = b
        heapq.heappush(self.heap, (-b.value, b.gen, rid))
        if len(self.heap) > 2 * len(self.values) + 64:  # values gone since: rebuild
            self.heap = [(-v.value, v.gen, r) for r, v in self.values.items()]
            heapq.heapify(self.heap)


class PendingCounts:
    """Monotone totals, by outcome (the service exports them as a counter)."""

    __slots__ = ("added", "released", "confirmed", "expired", "dropped", "cleared")

    def __init__(self) -> None:
        self.added = self.released = self.confirmed = self.expired = self.dropped = self.cleared = 0

    def items(self) -> list[tuple[str, int]]:
        return [(k, getattr(self, k)) for k in self.__slots__]


def busy_ok(value: float | None) -> bool:
    """A `busy_until` that may be kept: finite and within BUSY_LIMIT."""
    return value is not None and math.isfinite(value) and -BUSY_LIMIT <= value <= BUSY_LIMIT


class PendingRoutes:
    """Per model, per (worker, dp_rank): request_id -> the request's full-block keys, with an expiry.

    `run(model, pair, keys, start)` is the number of consecutive `keys[start:]` pending on `pair`.
    Keys are chained (a key names its whole prefix), and every route holds all its blocks, so a
    pending key implies its prefix is pending on that worker too. For a hybrid model (`ends_only`)
    the run stops at the last block where a route ends: the one prefix of an in-flight request a
    hybrid worker surely leaves usable (its window and its last Mamba state sit there).

    `load(model, pair)` is the pair's in-flight load from the same routes: how many, and the prefill
    tokens they bring (each route's own, given when it is added). `busy_until(model, pair, now)` is the
    largest `busy_until` routes to the pair carried (a reporting router's own estimate of when that worker
    is done with what was routed to it; opaque here beyond its bounds). A value lives as long as its
    route: released, expired, dropped or cleared, it goes; confirmed (the worker's events landed), it
    stays until the route's TTL: an end time does not end when the prefill's blocks are stored.

    Admission (causal forwarding): a route added with `admits` is *awaiting* until `admit` says the
    worker accepted it into its queue, its admission deadline (`admit_timeout_s`) passes, or the route
    goes. `blockers(model, pair, key)` names the awaiting routes to a pair that hold a key: a later
    route whose prediction counted that key is forwarded only once they are admitted, so it reaches
    the worker after them. `on_settle(model, request_id)` is called when a route stops awaiting."""

    __slots__ = ("ttl_s", "max_routes", "max_blocks", "max_pair_routes", "max_pair_blocks", "admit_timeout_s",
                 "counts", "admission_expired", "busy_refused", "on_settle", "_routes", "_held", "_ends", "_heap",
                 "_admit_heap", "_gen", "_blocks", "_load", "_busy", "_busy_at", "_awaiting", "_handles")

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_routes: int = DEFAULT_MAX_ROUTES,
                 max_blocks: int = DEFAULT_MAX_BLOCKS, max_pair_routes: int = DEFAULT_MAX_PAIR_ROUTES,
                 max_pair_blocks: int = DEFAULT_MAX_PAIR_BLOCKS,
                 admit_timeout_s: float = DEFAULT_ADMIT_TIMEOUT_S) -> None:
        if not (ttl_s > 0 and admit_timeout_s > 0) or min(max_routes, max_blocks, max_pair_routes,
                                                          max_pair_blocks) < 1:
            raise ValueError("pending routes need ttl_s > 0, admit_timeout_s > 0 and caps >= 1")
        self.ttl_s = ttl_s
        self.max_routes = max_routes
        self.max_blocks = max_blocks
        self.max_pair_routes = min(max_pair_routes, max_routes)
        self.max_pair_blocks = min(max_pair_blocks, max_blocks)
        self.admit_timeout_s = admit_timeout_s
        self.counts = PendingCounts()
        self.admission_expired = 0  # routes whose admission deadline passed while they awaited it
        self.busy_refused = 0       # busy_until values not kept (not finite, or beyond BUSY_LIMIT)
        self.on_settle: Callable[[str, str], None] | None = None
        self._routes: dict[str, dict[str, PendingRoute]] = {}              # model -> request_id -> route
        self._held: dict[str, dict[Pair, dict[int, int]]] = {}             # model -> pair -> key -> refs
        self._ends: dict[str, dict[Pair, dict[int, int]]] = {}             # the same, routes' last keys
        self._heap: list[tuple[float, int, str, str, Pair]] = []           # (expires_at, gen, model, id, pair)
        self._admit_heap: list[tuple[float, int, str, str]] = []           # (admit by, gen, model, id)
        self._gen = 0
        self._blocks = 0
        self._load: dict[str, dict[Pair, PairLoad]] = {}                   # model -> pair -> in-flight load
        self._busy: dict[str, dict[Pair, _PairBusy]] = {}                  # model -> pair -> busy_until values
        self._busy_at: dict[str, dict[str, tuple[Pair, int]]] = {}         # model -> id -> (pair, gen) of its value
        self._awaiting: dict[str, dict[Pair, dict[str, PendingRoute]]] = {}  # model -> pair -> id -> route
        self._handles: dict[str, PendingRoute] = {}                        # handle -> route awaiting admission

    # -- size ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(len(r) for r in self._routes.values())

    @property
    def blocks(self) -> int:
        return self._blocks

    @property
    def awaiting_count(self) -> int:
        return sum(len(w) for by_pair in self._awaiting.values() for w in by_pair.values())

    def active_any(self) -> bool:
        """Any `busy_until` held (of confirmed routes too): the timer still has expiry to run."""
        return bool(self._busy)

    def has(self, model: str) -> bool:
        return bool(self._routes.get(model))

    def active(self, model: str) -> bool:
        """Routes pending or a `busy_until` held for the model: its `/score` rows carry pending fields."""
        return bool(self._routes.get(model)) or bool(self._busy.get(model))

    def routes(self, model: str) -> Iterator[PendingRoute]:
        return iter(list(self._routes.get(model, {}).values()))

    def get(self, model: str, request_id: str) -> PendingRoute | None:
        return self._routes.get(model, {}).get(request_id)

    def worker_routes(self, model: str, worker_id: str) -> list[str]:
        """Ids of the routes to any rank of the worker (oldest first per rank)."""
        return [rid for pair, ld in self._load.get(model, {}).items() if pair[0] == worker_id for rid in ld.routes]

    def workers(self, model: str) -> set[str]:
        return {pair[0] for pair in self._load.get(model, {})}

    def pairs(self, model: str) -> list[Pair]:
        return [p for p, held in self._held.get(model, {}).items() if held]

    # -- changes -------------------------------------------------------------------------------
    def add(self, model: str, request_id: str, worker_id: str, dp_rank: int, keys: Sequence[int],
            now: float, ttl_s: float | None = None, prefill_tokens: int = 0,
            busy_until: float | None = None, admits: bool = False, handle: str | None = None) -> int:
        """Record a route (replacing an earlier one with the same id); returns the blocks it holds.
        `prefill_tokens`: what the worker will compute for it (its `load`); `busy_until`: see the class;
        `admits`: its router will report the worker's admission (`admit`), `handle` names it to waiters
        meanwhile. Beyond the caps the oldest routes (of the pair first, then overall) are dropped
        (counted)."""
        self._remove(model, request_id)
        self._forget_busy(model, request_id)  # a confirmed earlier route's value, wherever it was
        keys = tuple(keys)
        pair = (worker_id, dp_rank)
        if len(keys) > self.max_pair_blocks:
            self.counts.dropped += 1
            return 0
        self._gen += 1
        expires = now + (self.ttl_s if ttl_s is None else ttl_s)
        if busy_until is not None:
            if busy_ok(busy_until):
                pb = self._busy.setdefault(model, {}).setdefault(pair, _PairBusy())
                pb.put(request_id, _Busy(busy_until, expires, self._gen))
                self._busy_at.setdefault(model, {})[request_id] = (pair, self._gen)
                if len(pb.values) > self.max_pair_routes:  # values of confirmed routes past the pair's cap
                    old = next(iter(pb.values))
                    self._drop_busy(model, pair, old, pb.values[old].gen)
            else:
                self.busy_refused += 1
        awaiting = admits and bool(keys)  # a route holding no block is nobody's dependency
        r = PendingRoute(model, request_id, pair, keys, expires, self._gen, max(0, prefill_tokens), awaiting,
                         handle if awaiting else None)
        self._routes.setdefault(model, {})[request_id] = r
        if awaiting:
            self._awaiting.setdefault(model, {}).setdefault(pair, {})[request_id] = r
            heapq.heappush(self._admit_heap, (now + self.admit_timeout_s, r.gen, model, request_id))
            if r.handle is not None:
                self._handles[r.handle] = r
        ld = self._load.setdefault(model, {}).setdefault(pair, PairLoad())
        ld.requests += 1
        ld.prefill_tokens += r.prefill
        ld.blocks += len(keys)
        ld.routes[request_id] = r
        if keys:  # a prompt shorter than a block holds nothing (and leaves no empty entry behind)
            held = self._held.setdefault(model, {}).setdefault(pair, {})
            for k in keys:
                held[k] = held.get(k, 0) + 1
            ends = self._ends.setdefault(model, {}).setdefault(pair, {})
            ends[keys[-1]] = ends.get(keys[-1], 0) + 1
        self._blocks += len(keys)
        heapq.heappush(self._heap, (expires, r.gen, model, request_id, pair))
        self.counts.added += 1
        while ld.requests > self.max_pair_routes or ld.blocks > self.max_pair_blocks:
            self._drop(model, next(iter(ld.routes)))
        self._enforce_caps()
        return len(keys) if request_id in self._routes.get(model, {}) else 0

    def release(self, model: str, request_id: str) -> int:
        """Forget a finished (or failed) request's route and its `busy_until` (also once confirmed: the
        request is done); returns the blocks it held (0: unknown, or confirmed or expired already)."""
        r = self._remove(model, request_id)
        self._forget_busy(model, request_id)
        if r is None:
            return 0
        self.counts.released += 1
        return len(r.keys)

    def discard(self, model: str, request_id: str) -> None:
        """Forget a route about to be reported again (uncounted: `add` replaces it)."""
        self._remove(model, request_id)

    def admit(self, model: str, request_id: str) -> bool:
        """The worker accepted the route's request into its queue; True if it was awaiting that."""
        r = self._routes.get(model, {}).get(request_id)
        if r is None or not r.awaiting:
            return False
        self._settle(r)
        return True

    def confirm(self, model: str, request_id: str) -> int:
        """The worker's store events cover the route: exact residency takes over (its `busy_until`
        stays until its TTL)."""
        r = self._remove(model, request_id, keep_busy=True)
        if r is None:
            return 0
        self.counts.confirmed += 1
        return len(r.keys)

    def expire(self, now: float) -> int:
        """Drop every route whose expiry is at or before `now` (and end the admission wait of routes
        past their admission deadline); returns how many routes."""
        n = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, gen, model, rid, pair = heapq.heappop(heap)
            r = self._routes.get(model, {}).get(rid)
            if r is not None and r.gen == gen:
                self._remove(model, rid)
                n += 1
            else:  # a confirmed route's busy_until ends with its TTL
                self._drop_busy(model, pair, rid, gen)
        self.counts.expired += n
        admit_heap = self._admit_heap
        while admit_heap and admit_heap[0][0] <= now:
            _, gen, model, rid = heapq.heappop(admit_heap)
            r = self._routes.get(model, {}).get(rid)
            if r is not None and r.gen == gen and r.awaiting:
                self._settle(r)
                self.admission_expired += 1
        return n

    def clear_worker(self, model: str, worker_id: str, dp_rank: int | None = None) -> int:
        """Forget a worker's routes (removed, cleared, resynced, restarted); returns how many."""
        busy = self._busy.get(model, {})
        for pair in [p for p in busy if p[0] == worker_id and (dp_rank is None or p[1] == dp_rank)]:
            for rid, b in list(busy[pair].values.items()):
                self._drop_busy(model, pair, rid, b.gen)
        gone = [rid for pair, ld in self._load.get(model, {}).items()
                if pair[0] == worker_id and (dp_rank is None or pair[1] == dp_rank) for rid in ld.routes]
        for rid in gone:
            self._remove(model, rid)
        self.counts.cleared += len(gone)
        return len(gone)

    def clear_model(self, model: str) -> int:
        self._busy.pop(model, None)
        self._busy_at.pop(model, None)
        gone = list(self._routes.get(model, {}))
        for rid in gone:
            self._remove(model, rid)
        self.counts.cleared += len(gone)
        return len(gone)

    # -- queries -------------------------------------------------------------------------------
    def run(self, model: str, worker_id: str, dp_rank: int, keys: Sequence[int], start: int = 0,
            ends_only: bool = False) -> int:
        """Consecutive `keys[start:]` pending on (worker_id, dp_rank); with `ends_only` cut back to
        the last of them where a route ends (hybrid models)."""
        held = self._held.get(model, {}).get((worker_id, dp_rank))
        if not held:
            return 0
        n = 0
        for i in range(start, len(keys)):
            if keys[i] not in held:
                break
            n += 1
        if ends_only:
            ends = self._ends.get(model, {}).get((worker_id, dp_rank), {})
            while n and keys[start + n - 1] not in ends:
                n -= 1
        return n

    def blockers(self, model: str, worker_id: str, dp_rank: int, key: int) -> list[PendingRoute]:
        """The routes to (worker_id, dp_rank) awaiting admission that hold `key`; none when a route
        not awaiting it holds the key too (admitted: the worker has the request, so the key is there
        for whatever it takes next; or from a router that does not report admission)."""
        waiting = self._awaiting.get(model, {}).get((worker_id, dp_rank))
        if not waiting:
            return []
        found = [r for r in waiting.values() if key in r.keys]
        holders = self._held.get(model, {}).get((worker_id, dp_rank), {}).get(key, 0)
        return found if holders <= len(found) else []

    def awaiting(self, model: str, request_id: str) -> bool:
        """The route is held and its admission not reported yet."""
        r = self._routes.get(model, {}).get(request_id)
        return r is not None and r.awaiting

    def by_handle(self, handle: str) -> PendingRoute | None:
        """The route awaiting admission that `handle` names (None: none does now)."""
        return self._handles.get(handle)

    def load(self, model: str, worker_id: str, dp_rank: int) -> PairLoad | None:
        """The pair's in-flight load (None: no route pending there)."""
        return self._load.get(model, {}).get((worker_id, dp_rank))

    def busy_until(self, model: str, worker_id: str, dp_rank: int, now: float) -> float | None:
        """The largest `busy_until` the pair's routes carry (None: none)."""
        pb = self._busy.get(model, {}).get((worker_id, dp_rank))
        return None if pb is None else pb.top(now)

    # -- internals -----------------------------------------------------------------------------
    def _settle(self, r: PendingRoute) -> None:
        """The route no longer awaits admission."""
        r.awaiting = False
        if r.handle is not None:
            self._handles.pop(r.handle, None)
        by_pair = self._awaiting[r.model]
        waiting = by_pair[r.pair]
        del waiting[r.request_id]
        if not waiting:
            del by_pair[r.pair]
            if not by_pair:
                del self._awaiting[r.model]
        if self.on_settle is not None:
            self.on_settle(r.model, r.request_id)

    def _drop_busy(self, model: str, pair: Pair, rid: str, gen: int) -> None:
        by_pair = self._busy.get(model)
        if by_pair is None:
            return
        pb = by_pair.get(pair)
        b = pb.values.get(rid) if pb is not None else None
        if pb is None or b is None or b.gen != gen:
            return
        del pb.values[rid]
        at = self._busy_at[model]
        del at[rid]
        if not at:
            del self._busy_at[model]
        if not pb.values:
            del by_pair[pair]
            if not by_pair:
                del self._busy[model]

    def _forget_busy(self, model: str, rid: str) -> None:
        got = self._busy_at.get(model, {}).get(rid)
        if got is not None:
            self._drop_busy(model, got[0], rid, got[1])

    def _drop(self, model: str, request_id: str) -> None:
        if self._remove(model, request_id) is not None:
            self.counts.dropped += 1

    def _remove(self, model: str, request_id: str, keep_busy: bool = False) -> PendingRoute | None:
        routes = self._routes.get(model)
        r = routes.pop(request_id, None) if routes else None
        if r is None:
            return None
        if not keep_busy:
            self._drop_busy(model, r.pair, request_id, r.gen)
        if r.awaiting:
            self._settle(r)
        if not routes:
            del self._routes[model]
        loads = self._load[model]
        ld = loads[r.pair]
        ld.requests -= 1
        ld.prefill_tokens -= r.prefill
        ld.blocks -= len(r.keys)
        del ld.routes[request_id]
        if not ld.requests:
            del loads[r.pair]
            if not loads:
                del self._load[model]
        if r.keys:
            by_pair = self._held[model]
            held = by_pair[r.pair]
            for k in r.keys:
                c = held[k] - 1
                if c:
                    held[k] = c
                else:
                    del held[k]
            if not held:
                del by_pair[r.pair]
                if not by_pair:
                    del self._held[model]
            ends_by_pair = self._ends[model]
            ends = ends_by_pair[r.pair]
            last = r.keys[-1]
            if ends[last] > 1:
                ends[last] -= 1
            else:
                del ends[last]
            if not ends:
                del ends_by_pair[r.pair]
                if not ends_by_pair:
                    del self._ends[model]
        self._blocks -= len(r.keys)
        return r

    def _enforce_caps(self) -> None:
        heap = self._heap
        while (len(self) > self.max_routes or self._blocks > self.max_blocks) and heap:
            _, gen, model, rid, pair = heapq.heappop(heap)
            r = self._routes.get(model, {}).get(rid)
            if r is not None and r.gen == gen:
                self._drop(model, rid)
            else:
                self._drop_busy(model, pair, rid, gen)
        live = len(self)
        if len(heap) > 4 * max(64, live):  # stale entries of released routes: rebuild (keeping busy values)
            self._heap = [(r.expires_at, r.gen, r.model, r.request_id, r.pair)
                          for routes in self._routes.values() for r in routes.values()]
            self._heap += [(b.expires, b.gen, model, rid, pair) for model, by_pair in self._busy.items()
                           for pair, pb in by_pair.items() for rid, b in pb.values.items()
                           if self.get(model, rid) is None]
            heapq.heapify(self._heap)
        if len(self._admit_heap) > 4 * max(64, self.awaiting_count):
            self._admit_heap = [item for item in self._admit_heap if self.awaiting(item[2], item[3])]
            heapq.heapify(self._admit_heap)
