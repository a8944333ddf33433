"""Per-model, per-worker counters of the OpenAI proxy's decisions, and the last sampled decisions
(docs/openai.md, "Router page"). Plain data: each hook is an O(1) update on the request path
(a dict look-up and a few increments); the page (router/proxy/page.py) reads them when polled.

Outcomes of a routed request (counted once, for the worker it was forwarded to): `scored` (the
index was read), `fallback` (decided without it because the indexer could not answer, or decided
again on another worker after a connection failure), `unscored` (nothing to score: no tokens, no
indexer); `errors`: answers the engine broke off; `answered`: answers relayed to their end."""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Protocol, Sized

from router.proxy.stats import Accuracy, Histogram

# Decisions kept for the page (the sampled share of `--decision-log-rate`).
LAST_DECISIONS = 50


class RouteView(Protocol):
    """What a hook reads of a route (router/proxy/core.py's Route)."""

    @property
    def request_id(self) -> str: ...

    @property
    def worker_id(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def policy(self) -> str: ...

    @property
    def scored(self) -> bool: ...

    @property
    def unscored_reason(self) -> str: ...

    @property
    def cached_tokens(self) -> int | None: ...

    @property
    def decide_s(self) -> float: ...

    @property
    def tokens(self) -> Sized | None: ...


class Cell(Accuracy):
    """One (model, worker): its outcomes, and the accuracy of its scored routes' predictions."""

    __slots__ = ("routed", "scored", "unscored", "fallback", "errors", "answered")

    def __init__(self) -> None:
        super().__init__()
        self.routed = 0
        self.scored = 0
        self.unscored = 0
        self.fallback = 0
        self.errors = 0
        self.answered = 0

    def add(self, other: Cell) -> None:
        for k in (*Accuracy.__slots__, *Cell.__slots__):
            setattr(self, k, getattr(self, k) + getattr(other, k))


class Sample:
    """One sampled decision, completed when its answer ends."""

    __slots__ = ("at", "request_id", "model", "worker_id", "policy", "prompt_tokens", "predicted", "scored",
                 "unscored_reason", "decide_ms", "served", "outcome")

    def __init__(self, at: float, request_id: str, model: str, worker_id: str, policy: str, prompt_tokens: int | None,
                 predicted: int | None, scored: bool, unscored_reason: str, decide_ms: float) -> None:
        self.at = at
        self.request_id = request_id
        self.model = model
        self.worker_id = worker_id
        self.policy = policy
        self.prompt_tokens = prompt_tokens
        self.predicted = predicted
        self.scored = scored
        self.unscored_reason = unscored_reason
        self.decide_ms = decide_ms
        self.served: int | None = None    # the engine's cached tokens, when it said
        self.outcome = "pending"          # pending | answered | error


def outcome_of(scored: bool, unscored_reason: str) -> str:
    if scored:
        return "scored"
    return "fallback" if unscored_reason == "retried" or unscored_reason.startswith("indexer_") else "unscored"


class Tally:
    __slots__ = ("cells", "latency", "samples", "_pending", "started", "clock")

    def __init__(self, last: int = LAST_DECISIONS, clock: Callable[[], float] = time.time) -> None:
        self.cells: dict[tuple[str, str], Cell] = {}     # (model, worker) -> counters
        self.latency: dict[str, Histogram] = {}          # model -> decision latency of its routed requests
        self.samples: deque[Sample] = deque(maxlen=max(1, last))
        self._pending: dict[str, Sample] = {}            # request id -> its sample, until the answer ends
        self.clock = clock
        self.started = clock()

    def _cell(self, route: RouteView) -> Cell:
        key = (route.model, route.worker_id)
        c = self.cells.get(key)
        if c is None:
            c = self.cells[key] = Cell()
        return c

    def sample(self, route: RouteView) -> None:
        """A decision the decision log sampled."""
        s = Sample(self.clock(), route.request_id, route.model, route.worker_id, route.policy,
                   None if route.tokens is None else len(route.tokens),
                   route.cached_tokens, route.scored, route.unscored_reason, route.decide_s * 1e3)
        if len(self.samples) == self.samples.maxlen:
            self._pending.pop(self.samples[0].request_id, None)
        self.samples.append(s)
        self._pending[s.request_id] = s

    def routed(self, route: RouteView) -> None:
        """The request was forwarded (its answer's head arrived) to `route.worker_id`."""
        c = self._cell(route)
        c.routed += 1
        kind = outcome_of(route.scored, route.unscored_reason)
        if kind == "scored":
            c.scored += 1
        elif kind == "fallback":
            c.fallback += 1
        else:
            c.unscored += 1
        h = self.latency.get(route.model)
        if h is None:
            h = self.latency[route.model] = Histogram()
        h.observe(route.decide_s)

    def answered(self, route: RouteView, served: int | None) -> None:
        """The answer was relayed to its end; `served`: the engine's cached tokens (None: not said,
        or not read because the route was not scored)."""
        c = self._cell(route)
        c.answered += 1
        predicted = route.cached_tokens
        if served is not None and route.scored and predicted is not None:
            c.observe(predicted, served)
        if self._pending:
            s = self._pending.pop(route.request_id, None)
            if s is not None:
                s.outcome, s.served, s.worker_id = "answered", served, route.worker_id
                s.predicted, s.scored, s.unscored_reason = predicted, route.scored, route.unscored_reason

    def broke(self, route: RouteView) -> None:
        """The engine's answer broke off."""
        self._cell(route).errors += 1
        if self._pending:
            s = self._pending.pop(route.request_id, None)
            if s is not None:
                s.outcome, s.worker_id = "error", route.worker_id
