"""Routing policies: pure decisions over what the router knows at one instant (docs/end-to-end.md,
"Policies"). No I/O: the router shell fetches `/score` rows and worker load and passes them in.

- round_robin, random: no cache knowledge.
- least_loaded: smallest prefill backlog.
- approximate: the router's own guess of each worker's cache from its past routing decisions
  (no events), thresholded the way SGLang's cache-aware router is.
- precise_gpu: the index's device blocks + pending blocks + load; host/disk/shared copies count as misses.
- precise_tiered: the index's tier split + pending blocks + load, costing each tier's load-back like
  the engine. For a hybrid model the cached prefix is the usable one (`cached_blocks`).
- precise_kv_only: precise_tiered on `kv_blocks`, the full-attention-only match (what group-blind
  indexers such as Dynamo's or llm-d's answer for a hybrid model); the same as precise_tiered on a
  full-attention model.

The precise policies cost a request on each worker as the engine will see it when it runs:
backlog (virtual seconds of work queued ahead of it) + load-back of the blocks the worker holds
exactly below the GPU + prefill of the rest, where blocks *pending* on that worker (in-flight
requests routed there, reported to the index with `POST /routes`) count as cached: a worker runs
its requests in order, so they will have been computed by the time this one runs.
"""
from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from sim.api import SimModel

POLICIES = ("round_robin", "random", "least_loaded", "approximate", "precise_gpu", "precise_tiered",
            "precise_kv_only")
PRECISE = ("precise_gpu", "precise_tiered", "precise_kv_only")


class ScoreRow:
    """One worker's `/score` answer, in blocks."""

    __slots__ = ("device", "cached", "host", "disk", "shared", "pending", "kv", "inflight", "inflight_prefill",
                 "busy_until")

    def __init__(self, device: int = 0, cached: int = 0, host: int = 0, disk: int = 0, shared: int = 0,
                 pending: int = 0, kv: int | None = None, inflight: int = 0, inflight_prefill: int = 0,
                 busy_until: float | None = None) -> None:
        self.device = device
        self.cached = cached
        self.host = host
        self.disk = disk
        self.shared = shared
        self.pending = pending  # leading blocks past `cached` that in-flight routes to this worker hold
        # hybrid models: the full-attention-only match over any tier (`kv_blocks`); else `cached`
        self.kv = cached if kv is None else kv
        # every router replica's routes to this worker not yet confirmed by its events (pending_requests)
        # and the tokens they will prefill there (pending_prefill_tokens): the shared in-flight load
        self.inflight = inflight
        self.inflight_prefill = inflight_prefill
        self.busy_until = busy_until  # the largest end time any replica reported with a route here

    @classmethod
    def from_answer(cls, row: Mapping[str, object]) -> ScoreRow:
        """A `/score` answer's row (JSON or msgpack, decoded to plain data)."""
        t = row.get("tiers") or {}
        assert isinstance(t, Mapping)
        kv = row.get("kv_blocks")
        return cls(row["device_blocks"], row["cached_blocks"], t.get("host", 0), t.get("disk", 0),  # type: ignore[arg-type]
                   t.get("shared", 0), row.get("pending_blocks", 0), kv,  # type: ignore[arg-type]
                   row.get("pending_requests", 0), row.get("pending_prefill_tokens", 0),  # type: ignore[arg-type]
                   row.get("busy_until"))  # type: ignore[arg-type]


def shared_backlog(sim: SimModel, reported_s: float, row: ScoreRow) -> float:
    """A worker's queue as every router replica sees it at once: its own last load report
    (`reported_s`, virtual seconds of work ahead) plus the prefill of the routes any replica has sent
    it that its events do not cover yet (they have not reached it, or their stores are not visible:
    mostly not in its report either). A replica's own view knows only its own sends since that report,
    so several replicas picking at once in a burst all see the same idle worker."""
    if not row.inflight:
        return reported_s
    return reported_s + row.inflight * sim.prefill_overhead_s + row.inflight_prefill / sim.prefill_tokens_per_s


class RouteInput:
    """Everything a policy may look at for one request."""

    __slots__ = ("tokens", "block_keys", "block_size", "scores", "backlog", "inflight")

    def __init__(self, tokens: int, block_keys: Sequence[bytes], block_size: int,
                 scores: Mapping[str, ScoreRow] | None, backlog: Mapping[str, float],
                 inflight: Mapping[str, int]) -> None:
        self.tokens = tokens
        self.block_keys = block_keys      # chained per-block keys (approximate's own tree)
        self.block_size = block_size
        self.scores = scores              # None for policies that do not ask the index
        self.backlog = backlog            # virtual seconds of prefill queued per worker
        self.inflight = inflight          # this router's own outstanding requests per worker


class Decision:
    __slots__ = ("worker_id", "predicted_cached", "est_cost_s", "predicted_pending")

    def __init__(self, worker_id: str, predicted_cached: int | None, est_cost_s: float,
                 predicted_pending: int = 0) -> None:
        self.worker_id = worker_id
        self.predicted_cached = predicted_cached  # tokens served from cache; None = the policy makes no prediction
        self.est_cost_s = est_cost_s              # its own estimate of the prefill work it adds
        self.predicted_pending = predicted_pending  # of which: tokens in-flight requests will have stored


class Policy:
    name = "base"
    uses_index = False

    def __init__(self, workers: Sequence[str], sim: SimModel, seed: int = 0) -> None:
        if not workers:
            raise ValueError("a policy needs at least one worker")
        self.workers = list(workers)
        self.sim = sim

    def choose(self, inp: RouteInput) -> Decision:  # pragma: no cover - interface
        raise NotImplementedError

    def _plain_cost(self, inp: RouteInput) -> float:
        return self.sim.prefill_s(inp.tokens)


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, workers: Sequence[str], sim: SimModel, seed: int = 0) -> None:
        super().__init__(workers, sim, seed)
        self._next = seed % len(self.workers)

    def choose(self, inp: RouteInput) -> Decision:
        w = self.workers[self._next]
        self._next = (self._next + 1) % len(self.workers)
        return Decision(w, None, self._plain_cost(inp))


class Random(Policy):
    name = "random"

    def __init__(self, workers: Sequence[str], sim: SimModel, seed: int = 0) -> None:
        super().__init__(workers, sim, seed)
        self._rng = random.Random(seed)

    def choose(self, inp: RouteInput) -> Decision:
        return Decision(self._rng.choice(self.workers), None, self._plain_cost(inp))


class LeastLoaded(Policy):
    name = "least_loaded"

    def choose(self, inp: RouteInput) -> Decision:
        w = min(self.workers, key=lambda w: (inp.backlog.get(w, 0.0), inp.inflight.get(w, 0), w))
        return Decision(w, None, self._plain_cost(inp))


class Approximate(Policy):
    """SGLang-router-style cache-aware routing from the router's own history: if load is badly
    imbalanced take the least-loaded worker; else if the best prefix match covers more than
    `cache_threshold` of the prompt take that worker; else the worker with the smallest tree.
    Its tree never learns of evictions (it has no events), so it forgets only by its own LRU bound."""

    name = "approximate"

    def __init__(self, workers: Sequence[str], sim: SimModel, seed: int = 0, *, cache_threshold: float = 0.5,
                 balance_abs: int = 32, balance_rel: float = 1.5, max_tree_blocks: int = 1 << 20) -> None:
        super().__init__(workers, sim, seed)
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_tree_blocks = max_tree_blocks
        self.trees: dict[str, OrderedDict[bytes, None]] = {w: OrderedDict() for w in self.workers}

    def match(self, w: str, keys: Sequence[bytes]) -> int:
        tree = self.trees[w]
        n = 0
        for k in keys:
            if k not in tree:
                break
            n += 1
        return n

    def choose(self, inp: RouteInput) -> Decision:
        loads = {w: inp.inflight.get(w, 0) for w in self.workers}
        lo, hi = min(loads.values()), max(loads.values())
        matches = {w: self.match(w, inp.block_keys) for w in self.workers}
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            w = min(self.workers, key=lambda w: (loads[w], w))
        else:
            best = max(self.workers, key=lambda w: (matches[w], -loads[w]))
            rate = matches[best] * inp.block_size / max(1, inp.tokens)
            if rate > self.cache_threshold:
                w = best
            else:
                w = min(self.workers, key=lambda w: (len(self.trees[w]), loads[w], w))
        self._remember(w, inp.block_keys)
        cached = matches[w] * inp.block_size
        return Decision(w, cached, self.sim.prefill_s(inp.tokens - cached))

    def _remember(self, w: str, keys: Sequence[bytes]) -> None:
        tree = self.trees[w]
        for k in keys:
            tree[k] = None
            tree.move_to_end(k)
        while len(tree) > self.max_tree_blocks:
            tree.popitem(last=False)


class PreciseGpu(Policy):
    """Exact device blocks (+ pending) from the index; everything not on the GPU is costed as a recompute."""

    name = "precise_gpu"
    uses_index = True

    def __init__(self, workers: Sequence[str], sim: SimModel, seed: int = 0, *, work_weight: float = 3.0,
                 busy_s: float = 1.0, min_share: float = 0.5, keep_weight: float = 50.0, keep_share: float = 0.5,
                 reuse_requests: float = 100.0, reuse_weight: float = 0.6) -> None:
        super().__init__(workers, sim, seed)
        self.work_weight = work_weight
        self.busy_s = busy_s
        self.min_share = min_share
        self.keep_weight = keep_weight  # a continuing conversation's recompute: this many times the excess weight
        self.keep_share = keep_share    # ... when one worker holds more than this share of the prompt
        self.reuse_requests = reuse_requests  # decisions over which the work sent to a worker comes back
        self.reuse_weight = reuse_weight
        self.assigned = {w: 0.0 for w in self.workers}  # virtual seconds of work this policy has sent
        self.recent = {w: 0.0 for w in self.workers}    # the same, decayed over `reuse_requests` decisions

    def cached_blocks(self, row: ScoreRow) -> int:
        """Leading blocks the worker will serve from cache as this policy reads the row: every tier
        of the usable prefix and the blocks in-flight requests ahead of this one will have stored."""
        return row.cached + row.pending

    def cost(self, inp: RouteInput, row: ScoreRow) -> float:
        """Virtual seconds of load-back + prefill this request adds on that worker."""
        return self.sim.prefill_s(max(0, inp.tokens - (row.device + row.pending) * inp.block_size))

    def predicted_at_report(self, scored: ScoreRow | None, cached: int, pending: int) -> int:
        """Blocks the worker will serve from cache, read from the route report's answer (`cached`,
        `pending`: fresher than the score the decision used)."""
        return cached + pending

    def key(self, backlog: float, work: float, excess: float = 0.0) -> float:
        """Expected TTFT on a worker (its queue, then this request's own work), plus the delay that work
        imposes on the requests that will queue behind it: `work_weight - 1` more times the work on a
        busy worker (backlog >= `busy_s`), less on a quieter one, down to `min_share` of that on an idle
        one (requests still arrive while it works). On a busy worker a recompute is paid several times,
        so conversations stay where their cache is; a cold worker (one that has not seen a shared prefix
        yet) is still cheaper than a queue, so it is never locked out.

        `excess`: the part of the work another worker would not do (it holds more of the prompt): the
        fleet does it twice. It is charged `work_weight - 1` more times whatever this worker's queue:
        an idle worker's capacity is not free, the router fills it with the next requests, so a
        recompute anywhere takes capacity the fleet's later requests would have had. A conversation
        leaves the worker holding its prefix only for a queue there several times longer than the
        recompute."""
        share = max(self.min_share, min(1.0, backlog / self.busy_s))
        return backlog + work * (1.0 + (self.work_weight - 1.0) * share) + (self.work_weight - 1.0) * excess

    def choose(self, inp: RouteInput) -> Decision:
        scores = inp.scores or {}
        empty = ScoreRow()
        costs = {w: self.cost(inp, scores.get(w, empty)) for w in self.workers}
        least = min(costs.values())
        # A continuing conversation (some worker holds most of its prompt): giving its hit away costs
        # `keep_weight` times more; a new one (only a shared prefix is held) may teach another worker
        # that prefix for the next burst.
        held = max(self.cached_blocks(scores.get(w, empty)) for w in self.workers) * inp.block_size
        keep = self.keep_weight if held > self.keep_share * inp.tokens else 1.0
        self._decay()
        floor = min(self.recent.values())
        # A new conversation will come back where it starts: its later turns meet the work this worker
        # was recently sent (conversations that come back too), not only its queue now.
        reuse = self.reuse_weight if keep == 1.0 else 0.0
        key = {w: self.key(inp.backlog.get(w, 0.0), costs[w], (costs[w] - least) * keep)
               + reuse * (self.recent[w] - floor) for w in self.workers}
        best = min(key.values())
        # Ties (e.g. an idle fleet and no cache anywhere) go to the worker sent the least work so far,
        # not always to the first: new conversations spread, and their later turns follow them.
        w = min((w for w in self.workers if key[w] <= best + 1e-9),  # a nanosecond: aged-away work ties
                key=lambda w: (self.assigned[w], inp.inflight.get(w, 0), w))
        self.assigned[w] += costs[w]
        self.recent[w] += costs[w]
        row = scores.get(w, empty)
        b = inp.block_size
        # What the worker will serve from cache: everything it holds (any tier; the engine loads lower
        # tiers back) and what the in-flight requests ahead of this one will have stored.
        return Decision(w, min(inp.tokens, self.cached_blocks(row) * b), costs[w], row.pending * b)

    def _decay(self) -> None:
        """Age the recent work by one decision: it counts in routing decisions, not seconds, so the
        window follows the traffic's rate (a conversation comes back after about as many other
        requests at any load)."""
        f = math.exp(-1.0 / self.reuse_requests)
        for w in self.recent:
            self.recent[w] *= f


class PreciseTiered(PreciseGpu):
    """Exact tier split (+ pending) from the index: host / disk / shared blocks cost their load-back time."""

    name = "precise_tiered"

    def cost(self, inp: RouteInput, row: ScoreRow) -> float:
        b = inp.block_size
        cached = self.cached_blocks(row) * b
        return (self.sim.load_s(row.host * b, row.disk * b, row.shared * b)
                + self.sim.prefill_s(max(0, inp.tokens - cached)))


class PreciseKvOnly(PreciseTiered):
    """precise_tiered reading `kv_blocks` in place of the usable prefix: what a router on a
    group-blind index gets for a hybrid model (it promises full-attention hits the engine cannot
    resume from). The tier split is still the usable prefix's; the blocks past it cost nothing."""

    name = "precise_kv_only"

    def cached_blocks(self, row: ScoreRow) -> int:
        return max(row.kv, row.cached + row.pending)

    def predicted_at_report(self, scored: ScoreRow | None, cached: int, pending: int) -> int:
        return max(0 if scored is None else scored.kv, cached + pending)


_CLASSES: dict[str, type[Policy]] = {c.name: c for c in (RoundRobin, Random, LeastLoaded, Approximate,
                                                          PreciseGpu, PreciseTiered, PreciseKvOnly)}


def make_policy(name: str, workers: Sequence[str], sim: SimModel, seed: int = 0) -> Policy:
    cls = _CLASSES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
    return cls(workers, sim, seed)
