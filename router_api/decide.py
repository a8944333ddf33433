"""Score, choose and reserve in one step (`POST /routes/decide`, docs/openai.md "One round trip"):
the indexer scores the request, a chooser picks the worker (the router's policy run here, or the
router's own choice sent with the request) and the route is recorded as in flight, all before the
next decision of any router of this indexer starts. The second of two simultaneous requests for a
new shared prefix therefore counts the first's pending blocks: no burst is spread by a race.

`POST /routes/release` forgets many finished routes in one call (routers batch them off their
request path). Admission reports (causal forwarding: the worker began answering a route's request)
travel the same way: `admitted` on the next decision or on the batch, applied before anything else,
so a router makes one call per request. The chooser is given by whoever builds the app (the `kvatlas indexer` command wires
the routing policies of the `router` package); without one, only requests carrying their own
`choice` are served.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Annotated, Optional, Protocol

import numpy as np
from msgspec import Meta, Struct

from schemas.api import MAX_QUERY_TOKENS, Name, OptName, TokenList, WorkerScoreOut
from schemas.costmodel import SimModel

MAX_CANDIDATES = 1024
MAX_RELEASE = 4096


class Candidate(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A worker the router may send the request to, with the router's own view of its queue."""

    worker_id: Name
    backlog_s: Annotated[float, Meta(ge=0.0, le=1e6)] = 0.0  # seconds of work queued (polled load)
    inflight: Annotated[int, Meta(ge=0, le=1 << 20)] = 0     # this router's outstanding requests there


class DecideRequest(Struct, forbid_unknown_fields=True, omit_defaults=True):
    request_id: Name
    candidates: Annotated[list[Candidate], Meta(min_length=1, max_length=MAX_CANDIDATES)]
    model: Name = "default"
    # the prompt: little-endian u32 ids (`tokens`, msgpack bin) or a list (`token_ids`)
    tokens: Optional[Annotated[bytes, Meta(max_length=4 * MAX_QUERY_TOKENS)]] = None
    token_ids: Optional[TokenList] = None
    lora_name: OptName = None
    cache_salt: OptName = None
    policy: Name = "precise_tiered"
    sim: Optional[SimModel] = None
    choice: OptName = None    # the router chose already (a policy that does not read the index)
    admits: bool = False      # causal forwarding: answer `after`, the router reports admission
    reserve: bool = True      # record the route (False: score and choose only)
    # finished routes of this router, released before this decision (a router's releases ride on its
    # next request: a client's next request never sees its previous one still in flight)
    release: Annotated[list[Name], Meta(max_length=MAX_RELEASE)] = []
    # routes of this router whose requests the worker admitted (`admits`), applied first of all: this
    # decision already sees them admitted (like `POST /routes/admitted`, one call fewer per request)
    admitted: Annotated[list[Name], Meta(max_length=MAX_RELEASE)] = []


class DecideAnswer(Struct, omit_defaults=True):
    request_id: str
    worker_id: str
    block_size: int
    dp_rank: int = 0
    scored: bool = True           # False: the model is unknown here (nothing cached anywhere yet)
    reserved: bool = False        # the route is recorded (pending on worker_id until released)
    cached_blocks: int = 0        # the chosen worker's exact match, any tier
    device_blocks: int = 0
    pending_blocks: int = 0       # past it, held by earlier in-flight routes to that worker
    predicted_cached_tokens: Optional[int] = None  # the chooser's prediction (None: it makes none)
    after: list[str] = []         # routes to forward after (causal forwarding, `admits`)
    refused: Optional[str] = None  # why the route was not recorded (e.g. the worker is not registered)


class ReleaseRequest(Struct, forbid_unknown_fields=True, omit_defaults=True):
    request_ids: Annotated[list[Name], Meta(max_length=MAX_RELEASE)]
    model: Name = "default"
    admitted: Annotated[list[Name], Meta(max_length=MAX_RELEASE)] = []  # applied before the releases


class ReleaseAnswer(Struct):
    released: int   # routes found and forgotten
    blocks: int     # the blocks they held
    admitted: int = 0  # admission reports that found a route awaiting admission


class Choice(Struct):
    worker_id: str
    dp_rank: int = 0
    predicted_cached_tokens: Optional[int] = None


class Chooser(Protocol):
    """Picks a worker among `req.candidates` from the score rows (the holders' answer: the ranks that
    hold some of the prompt or have routes in flight, pending blocks included; a candidate without a
    row holds nothing); pure: no I/O, called under the decision lock."""

    def choose(self, req: DecideRequest, rows: Sequence[WorkerScoreOut], block_size: int, tokens: int) -> Choice: ...


class DecideService(Protocol):
    """The parts of the indexer service a decision uses (router_api.service.IndexerService)."""

    def score(self, model: str, token_ids: object, lora_name: str | None = None,
              cache_salt: str | None = None, limit: int | None = None) -> object: ...

    def report_route(self, model: str, request_id: str, worker_id: str, token_ids: object, dp_rank: int = 0,
                     lora_name: str | None = None, cache_salt: str | None = None,
                     busy_until: float | None = None, admits: bool = False) -> object: ...

    def release_route(self, model: str, request_id: str, fanout: bool = True) -> int: ...

    def admit_route(self, model: str, request_id: str, fanout: bool = True) -> bool: ...


class DecideError(ValueError):
    """A request this endpoint refuses (422)."""


class NoChooser(LookupError):
    """No chooser is wired and the request carries no `choice` (501)."""


def token_array(req: DecideRequest) -> np.ndarray:
    if req.tokens is not None:
        if len(req.tokens) % 4:
            raise DecideError("tokens must be little-endian u32 ids (a multiple of 4 bytes)")
        return np.frombuffer(req.tokens, dtype="<u4")
    if req.token_ids is not None:
        return np.asarray(req.token_ids, dtype=np.uint32)
    raise DecideError("give the prompt as tokens (u32 bytes) or token_ids")


class Decider:
    """One per indexer app: decisions run one at a time (score -> choose -> reserve under one lock)."""

    def __init__(self, service: DecideService, chooser: Chooser | None,
                 unknown_model: type[Exception], unknown_worker: type[Exception]) -> None:
        self.service = service
        self.chooser = chooser
        self._unknown_model = unknown_model
        self._unknown_worker = unknown_worker
        self._lock = threading.Lock()
        self.counts = {"decided": 0, "reserved": 0, "unknown_worker": 0, "unscored": 0, "released": 0,
                       "admitted": 0}

    def decide(self, req: DecideRequest) -> DecideAnswer:
        ids = token_array(req)
        if not len(ids):
            raise DecideError("the prompt is empty")
        names = [c.worker_id for c in req.candidates]
        if len(set(names)) != len(names):
            raise DecideError("candidates name a worker twice")
        if req.choice is not None and req.choice not in names:
            raise DecideError(f"choice {req.choice!r} is not among the candidates")
        if req.choice is None and self.chooser is None:
            raise NoChooser("this indexer chooses no worker itself: send `choice`")
        with self._lock:
            self._admit(req.model, req.admitted)
            for rid in req.release:
                self.counts["released"] += self.service.release_route(req.model, rid) > 0
            try:
                # the holders' answer (limit 0): a candidate without a row scores 0 with nothing in flight
                res = self.service.score(req.model, ids, req.lora_name, req.cache_salt, 0)
            except self._unknown_model:
                res = None
            rows: Sequence[WorkerScoreOut] = res.workers if res is not None else ()  # type: ignore[attr-defined]
            block_size = res.block_size if res is not None else 0  # type: ignore[attr-defined]
            if req.choice is not None:
                choice = Choice(req.choice)
            else:
                assert self.chooser is not None
                choice = self.chooser.choose(req, rows, block_size, len(ids))
            ans = DecideAnswer(req.request_id, choice.worker_id, block_size, choice.dp_rank, res is not None,
                               predicted_cached_tokens=choice.predicted_cached_tokens)
            row = next((r for r in rows if r.worker_id == choice.worker_id and r.dp_rank == choice.dp_rank), None)
            if row is not None:
                ans.cached_blocks, ans.device_blocks = row.cached_blocks, row.device_blocks
                ans.pending_blocks = row.pending_blocks or 0
            self.counts["decided"] += 1
            self.counts["unscored"] += res is None
            if req.reserve and res is not None:
                try:
                    rep = self.service.report_route(req.model, req.request_id, choice.worker_id, ids,
                                                    choice.dp_rank, req.lora_name, req.cache_salt, None, req.admits)
                except self._unknown_worker as exc:
                    self.counts["unknown_worker"] += 1
                    ans.refused = f"unknown_worker: {str(exc).strip(chr(39) + chr(34))}"
                else:
                    ans.reserved = True
                    ans.after = list(rep.after)  # type: ignore[attr-defined]
                    ans.cached_blocks = rep.cached_blocks  # type: ignore[attr-defined]
                    ans.pending_blocks = rep.pending_blocks  # type: ignore[attr-defined]
                    self.counts["reserved"] += 1
            elif req.reserve:
                ans.refused = f"unknown_model: {req.model!r} has no worker yet"
        return ans

    def _admit(self, model: str, ids: Sequence[str]) -> int:
        n = 0
        for rid in dict.fromkeys(ids):
            n += self.service.admit_route(model, rid)
        self.counts["admitted"] += n
        return n

    def release(self, req: ReleaseRequest) -> ReleaseAnswer:
        admitted = self._admit(req.model, req.admitted)
        n = blocks = 0
        for rid in dict.fromkeys(req.request_ids):
            held = self.service.release_route(req.model, rid)
            n += held > 0
            blocks += held
        self.counts["released"] += n
        return ReleaseAnswer(n, blocks, admitted)
