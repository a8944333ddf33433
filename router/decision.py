"""The routing decision, one home for every front end: score rows -> per-worker view (best dp rank,
in-flight load of all ranks) -> backlog (the router's polled view or every replica's unconfirmed
routes, whichever is larger) -> the policy's pick.

The OpenAI proxy runs it itself when the indexer cannot decide (no `POST /routes/decide`), and the
indexer runs it through `PolicyChooser` under its decision lock (router_api/decide.py): the same
code, so a decision does not depend on where it ran. Pure: no I/O, no clocks.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import msgspec
import numpy as np

from router.policies import Decision, Policy, RouteInput, ScoreRow, make_policy, shared_backlog
from router_api.decide import Choice, DecideError, DecideRequest
from schemas.api import WorkerScoreOut
from schemas.costmodel import SimModel

_DEFAULT_SIM = SimModel()


def block_keys(tokens: np.ndarray, block: int) -> list[bytes]:
    """Chained per-block keys (equal keys = equal prefix): the `approximate` policy's own content ids."""
    n = len(tokens) // block
    out: list[bytes] = []
    prev = b""
    data = np.ascontiguousarray(tokens[: n * block], dtype="<u4").tobytes()
    step = block * 4
    for i in range(n):
        prev = hashlib.blake2b(prev + data[i * step:(i + 1) * step], digest_size=16).digest()
        out.append(prev)
    return out


class WorkerView(msgspec.Struct):
    """Per worker: its best rank's row (in-flight load summed over its ranks) and that rank."""

    rows: dict[str, ScoreRow]
    ranks: dict[str, int]


def worker_view(rows: Sequence[Mapping[str, object]]) -> WorkerView:
    """`/score` answer rows (plain data) per worker: a data-parallel worker has a row per rank; the
    policy sees its best rank's match and the in-flight load of all its ranks together."""
    out: dict[str, ScoreRow] = {}
    ranks: dict[str, int] = {}
    load: dict[str, tuple[int, int]] = {}
    for row in rows:
        wid = str(row["worker_id"])
        cur = ScoreRow.from_answer(row)
        n, t = load.get(wid, (0, 0))
        load[wid] = (n + cur.inflight, t + cur.inflight_prefill)
        prev = out.get(wid)
        if prev is None or cur.cached > prev.cached:
            out[wid] = cur
            ranks[wid] = int(row.get("dp_rank", 0))  # type: ignore[call-overload]
    for w, r in out.items():
        r.inflight, r.inflight_prefill = load[w]
    return WorkerView(out, ranks)


def backlog_with_routes(sim: SimModel, backlog: Mapping[str, float], scores: Mapping[str, ScoreRow] | None
                        ) -> dict[str, float]:
    """Seconds of work ahead per worker: the router's polled view, or every replica's routes not yet
    confirmed (a real engine stores a request's blocks once its prefill ran, so they are the requests
    queued or prefilling there): the larger of the two views, not their sum."""
    out = dict(backlog)
    if scores:
        for w in out:
            row = scores.get(w)
            if row is not None:
                out[w] = max(out[w], shared_backlog(sim, 0.0, row))
    return out


def choose(policy: Policy, tokens: int, block_size: int, scores: Mapping[str, ScoreRow] | None,
           backlog: Mapping[str, float], inflight: Mapping[str, int], keys: Sequence[bytes] = ()) -> Decision:
    """The policy's pick among its workers (`policy.workers`)."""
    back = backlog_with_routes(policy.sim, backlog, scores)
    return policy.choose(RouteInput(tokens, keys, block_size, scores if policy.uses_index else None, back, inflight))


class PolicyChooser:
    """router_api.decide.Chooser over the routing policies: what `kvatlas indexer` wires, so routers
    may let the indexer decide and reserve in one step. One policy object per (policy, candidates,
    cost model), kept (bounded): its tie-break state is then shared by every router of this indexer."""

    def __init__(self, max_policies: int = 256) -> None:
        self._policies: OrderedDict[tuple[str, tuple[str, ...], SimModel], Policy] = OrderedDict()
        self._max = max_policies

    def _policy(self, name: str, workers: tuple[str, ...], sim: SimModel) -> Policy:
        key = (name, workers, sim)
        p = self._policies.get(key)
        if p is None:
            try:
                p = self._policies[key] = make_policy(name, workers, sim)
            except ValueError as exc:
                raise DecideError(str(exc)) from None
            if len(self._policies) > self._max:
                self._policies.popitem(last=False)
        else:
            self._policies.move_to_end(key)
        return p

    def choose(self, req: DecideRequest, rows: Sequence[WorkerScoreOut], block_size: int, tokens: int) -> Choice:
        workers = tuple(c.worker_id for c in req.candidates)
        pol = self._policy(req.policy, workers, req.sim or _DEFAULT_SIM)
        view = worker_view([msgspec.to_builtins(r) for r in rows if r.worker_id in workers])
        d = choose(pol, tokens, block_size or 16, view.rows, {c.worker_id: c.backlog_s for c in req.candidates},
                   {c.worker_id: c.inflight for c in req.candidates})
        return Choice(d.worker_id, view.ranks.get(d.worker_id, 0), d.predicted_cached)
