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
"""
from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

DEFAULT_TTL_S = 10.0          # a route not released or confirmed by then is forgotten
DEFAULT_MAX_ROUTES = 65_536   # entries over all models; the oldest are dropped beyond it
DEFAULT_MAX_BLOCKS = 4 << 20  # block keys over all entries; the oldest are dropped beyond it

Pair = tuple[str, int]  # (worker_id, dp_rank)


class PendingRoute:
    __slots__ = ("model", "request_id", "pair", "keys", "expires_at", "gen", "prefill", "awaiting")

    def __init__(self, model: str, request_id: str, pair: Pair, keys: tuple[int, ...], expires_at: float,
                 gen: int, prefill: int = 0, awaiting: bool = False) -> None:
        self.model = model
        self.request_id = request_id
        self.pair = pair
        self.keys = keys
        self.expires_at = expires_at
        self.gen = gen  # distinguishes a re-reported id from its earlier entry in the expiry heap
        self.prefill = prefill  # tokens the worker will compute for it (not cached nor pending when reported)
        self.awaiting = awaiting  # its router will report the worker's admission of it, not done yet


class PairLoad:
    """In-flight load of one (worker, dp_rank) from its pending routes: every router replica's."""

    __slots__ = ("requests", "prefill_tokens")

    def __init__(self) -> None:
        self.requests = 0
        self.prefill_tokens = 0


class PendingCounts:
    """Monotone totals, by outcome (the service exports them as a counter)."""

    __slots__ = ("added", "released", "confirmed", "expired", "dropped", "cleared")

    def __init__(self) -> None:
        self.added = self.released = self.confirmed = self.expired = self.dropped = self.cleared = 0

    def items(self) -> list[tuple[str, int]]:
        return [(k, getattr(self, k)) for k in self.__slots__]


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
    is done with what was routed to it; opaque here), kept for the TTL after it was reported whether or
    not its route is still pending: an end time, it does not end when the worker's events land.

    Admission (causal forwarding): a route added with `admits` is *awaiting* until `admit` says the
    worker accepted it into its queue (or the route goes). `blockers(model, pair, key)` names the
    awaiting routes to a pair that hold a key: a later route whose prediction counted that key is
    forwarded only once they are admitted, so it reaches the worker after them."""

    __slots__ = ("ttl_s", "max_routes", "max_blocks", "counts", "_routes", "_held", "_ends", "_heap", "_gen",
                 "_blocks", "_load", "_busy", "_awaiting")

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_routes: int = DEFAULT_MAX_ROUTES,
                 max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if ttl_s <= 0 or max_routes < 1 or max_blocks < 1:
            raise ValueError("pending routes need ttl_s > 0, max_routes >= 1 and max_blocks >= 1")
        self.ttl_s = ttl_s
        self.max_routes = max_routes
        self.max_blocks = max_blocks
        self.counts = PendingCounts()
        self._routes: dict[str, dict[str, PendingRoute]] = {}              # model -> request_id -> route
        self._held: dict[str, dict[Pair, dict[int, int]]] = {}             # model -> pair -> key -> refs
        self._ends: dict[str, dict[Pair, dict[int, int]]] = {}             # the same, routes' last keys
        self._heap: list[tuple[float, int, str, str]] = []                 # (expires_at, gen, model, id)
        self._gen = 0
        self._blocks = 0
        self._load: dict[str, dict[Pair, PairLoad]] = {}                   # model -> pair -> in-flight load
        self._busy: dict[str, dict[Pair, tuple[float, float]]] = {}        # model -> pair -> (busy_until, expires)
        self._awaiting: dict[str, dict[Pair, dict[str, PendingRoute]]] = {}  # model -> pair -> id -> route

    # -- size ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(len(r) for r in self._routes.values())

    @property
    def blocks(self) -> int:
        return self._blocks

    def has(self, model: str) -> bool:
        return bool(self._routes.get(model))

    def active(self, model: str) -> bool:
        """Routes pending or a `busy_until` held for the model: its `/score` rows carry pending fields."""
        return bool(self._routes.get(model)) or bool(self._busy.get(model))

    def routes(self, model: str) -> Iterator[PendingRoute]:
        return iter(list(self._routes.get(model, {}).values()))

    def pairs(self, model: str) -> list[Pair]:
        return [p for p, held in self._held.get(model, {}).items() if held]

    # -- changes -------------------------------------------------------------------------------
    def add(self, model: str, request_id: str, worker_id: str, dp_rank: int, keys: Sequence[int],
            now: float, ttl_s: float | None = None, prefill_tokens: int = 0,
            busy_until: float | None = None, admits: bool = False) -> int:
        """Record a route (replacing an earlier one with the same id); returns the blocks it holds.
        `prefill_tokens`: what the worker will compute for it (its `load`); `busy_until`: see the class;
        `admits`: its router will report the worker's admission (`admit`). Beyond the caps the oldest
        routes are dropped (counted)."""
        self._remove(model, request_id)
        keys = tuple(keys)
        if len(keys) > self.max_blocks:
            self.counts.dropped += 1
            return 0
        self._gen += 1
        expires = now + (self.ttl_s if ttl_s is None else ttl_s)
        if busy_until is not None and busy_until == busy_until:  # not NaN
            busy = self._busy.setdefault(model, {})
            cur = busy.get((worker_id, dp_rank))
            if cur is None or cur[1] <= now or busy_until >= cur[0]:
                busy[(worker_id, dp_rank)] = (busy_until, expires)
        r = PendingRoute(model, request_id, (worker_id, dp_rank), keys, expires, self._gen, max(0, prefill_tokens),
                         admits and bool(keys))  # a route holding no block is nobody's dependency
        self._routes.setdefault(model, {})[request_id] = r
        if r.awaiting:
            self._awaiting.setdefault(model, {}).setdefault(r.pair, {})[request_id] = r
        ld = self._load.setdefault(model, {}).setdefault(r.pair, PairLoad())
        ld.requests += 1
        ld.prefill_tokens += r.prefill
        if keys:  # a prompt shorter than a block holds nothing (and leaves no empty entry behind)
            held = self._held.setdefault(model, {}).setdefault(r.pair, {})
            for k in keys:
                held[k] = held.get(k, 0) + 1
            ends = self._ends.setdefault(model, {}).setdefault(r.pair, {})
            ends[keys[-1]] = ends.get(keys[-1], 0) + 1
        self._blocks += len(keys)
        heapq.heappush(self._heap, (expires, r.gen, model, request_id))
        self.counts.added += 1
        self._enforce_caps()
        return len(keys) if request_id in self._routes.get(model, {}) else 0

    def release(self, model: str, request_id: str) -> int:
        """Forget a finished (or failed) request's route; returns the blocks it held (0: unknown)."""
        r = self._remove(model, request_id)
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
        """The worker's store events cover the route: exact residency takes over."""
        r = self._remove(model, request_id)
        if r is None:
            return 0
        self.counts.confirmed += 1
        return len(r.keys)

    def expire(self, now: float) -> int:
        """Drop every route whose expiry is at or before `now`; returns how many."""
        n = 0
        for model in [m for m, busy in self._busy.items()
                      if any(exp <= now for _, exp in busy.values())]:
            busy = self._busy[model]
            for pair in [p for p, (_, exp) in busy.items() if exp <= now]:
                del busy[pair]
            if not busy:
                del self._busy[model]
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, gen, model, rid = heapq.heappop(heap)
            r = self._routes.get(model, {}).get(rid)
            if r is not None and r.gen == gen:
                self._remove(model, rid)
                n += 1
        self.counts.expired += n
        return n

    def clear_worker(self, model: str, worker_id: str, dp_rank: int | None = None) -> int:
        """Forget a worker's routes (removed, cleared, resynced, restarted); returns how many."""
        busy = self._busy.get(model, {})
        for pair in [p for p in busy if p[0] == worker_id and (dp_rank is None or p[1] == dp_rank)]:
            del busy[pair]
        if not busy:
            self._busy.pop(model, None)
        gone = [r.request_id for r in self._routes.get(model, {}).values()
                if r.pair[0] == worker_id and (dp_rank is None or r.pair[1] == dp_rank)]
        for rid in gone:
            self._remove(model, rid)
        self.counts.cleared += len(gone)
        return len(gone)

    def clear_model(self, model: str) -> int:
        self._busy.pop(model, None)
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

    def blockers(self, model: str, worker_id: str, dp_rank: int, key: int) -> list[str]:
        """Ids of the routes to (worker_id, dp_rank) awaiting admission that hold `key`; none when a
        route not awaiting it holds the key too (admitted: the worker has the request, so the key is
        there for whatever it takes next; or from a router that does not report admission)."""
        waiting = self._awaiting.get(model, {}).get((worker_id, dp_rank))
        if not waiting:
            return []
        ids = [rid for rid, r in waiting.items() if key in r.keys]
        holders = self._held.get(model, {}).get((worker_id, dp_rank), {}).get(key, 0)
        return ids if holders <= len(ids) else []

    def awaiting(self, model: str, request_id: str) -> bool:
        """The route is held and its admission not reported yet."""
        r = self._routes.get(model, {}).get(request_id)
        return r is not None and r.awaiting

    def load(self, model: str, worker_id: str, dp_rank: int) -> PairLoad | None:
        """The pair's in-flight load (None: no route pending there)."""
        return self._load.get(model, {}).get((worker_id, dp_rank))

    def busy_until(self, model: str, worker_id: str, dp_rank: int, now: float) -> float | None:
        """The largest `busy_until` routes to the pair carried within the TTL (None: none)."""
        got = self._busy.get(model, {}).get((worker_id, dp_rank))
        return None if got is None or got[1] <= now else got[0]

    # -- internals -----------------------------------------------------------------------------
    def _settle(self, r: PendingRoute) -> None:
        """The route no longer awaits admission."""
        r.awaiting = False
        by_pair = self._awaiting[r.model]
        waiting = by_pair[r.pair]
        del waiting[r.request_id]
        if not waiting:
            del by_pair[r.pair]
            if not by_pair:
                del self._awaiting[r.model]

    def _remove(self, model: str, request_id: str) -> PendingRoute | None:
        routes = self._routes.get(model)
        r = routes.pop(request_id, None) if routes else None
        if r is None:
            return None
        if r.awaiting:
            self._settle(r)
        if not routes:
            del self._routes[model]
        loads = self._load[model]
        ld = loads[r.pair]
        ld.requests -= 1
        ld.prefill_tokens -= r.prefill
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
            _, gen, model, rid = heapq.heappop(heap)
            r = self._routes.get(model, {}).get(rid)
            if r is not None and r.gen == gen:
                self._remove(model, rid)
                self.counts.dropped += 1
        if len(heap) > 4 * max(64, len(self)):  # stale heap entries of released routes: rebuild
            self._heap = [(r.expires_at, r.gen, r.model, r.request_id)
                          for routes in self._routes.values() for r in routes.values()]
            heapq.heapify(self._heap)
