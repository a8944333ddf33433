"""HTTP API types of a `kvatlas worker` (simulated-model engine). msgspec only, no logic, no torch
(docs/end-to-end.md). The cost model (`SimModel`) is schemas.costmodel's: routers price requests with it too."""
from __future__ import annotations

from typing import Annotated, Optional

from msgspec import Meta, Struct

from schemas.api import TokenList
from schemas.costmodel import SimModel

__all__ = ["SimModel", "GenerateRequest", "Tokens", "GenerateResponse", "LoadResponse", "WorkerHealth"]


class GenerateRequest(Struct, forbid_unknown_fields=True, omit_defaults=True):
    token_ids: TokenList
    max_tokens: Annotated[int, Meta(ge=0, le=1 << 20)] = 16
    # Virtual arrival time (s) on the replay clock; omitted = the worker's own clock.
    arrival_s: Optional[Annotated[float, Meta(ge=0)]] = None
    request_id: Optional[str] = None


class Tokens(Struct):
    """Token counts by where they came from."""

    gpu: int = 0
    host: int = 0
    disk: int = 0
    shared: int = 0
    computed: int = 0

    @property
    def cached(self) -> int:
        return self.gpu + self.host + self.disk + self.shared


class GenerateResponse(Struct):
    worker_id: str
    request_id: Optional[str]
    input_tokens: int
    output_tokens: int
    arrival_cached: int        # tokens the worker held (any tier) for this prompt when it arrived
    served: Tokens             # where the prompt's tokens came from when it ran
    queue_s: float
    load_s: float
    prefill_s: float
    ttft_s: float
    e2e_s: float


class LoadResponse(Struct):
    worker_id: str
    at_s: float
    queued: int
    running: int
    backlog_s: float           # virtual seconds before a new request's prefill could start
    free_pages: dict[str, int]
    total_pages: dict[str, int]
    # Virtual time the committed work ends (`at_s + backlog_s` unless at_s is past it): what a router
    # whose clock runs behind its trace (a loaded machine) must compare its requests' arrivals with.
    free_at_s: Optional[float] = None
    # `settle=true`: the seq of the last event batch the worker published once every request before
    # the call was served (an indexer that applied it sees everything they stored and moved)
    events_seq: Optional[int] = None


class WorkerHealth(Struct):
    status: str
    worker_id: str
    model: str
    block_size: int
    endpoint: str
    replay_endpoint: Optional[str]
    sim: SimModel
    l3: Optional[str]
    family: str = "full"       # full | mamba | swa | dsa (producer.components.families)
