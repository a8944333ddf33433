"""HTTP API types of a `kvatlas worker` (simulated-model engine) and of the replay report a
`kvatlas router` writes. msgspec only, no logic, no torch (docs/end-to-end.md)."""
from __future__ import annotations

from typing import Annotated, Optional

import msgspec
from msgspec import Meta, Struct

from schemas.api import TokenList


class SimModel(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The simulated model's costs. Times are virtual seconds (see docs/end-to-end.md)."""

    name: str = "sim-8b"
    kv_bytes_per_token: int = 131_072          # 32 layers x 8 KV heads x 128 dims x K+V x fp16
    prefill_tokens_per_s: float = 16_000.0     # compute-bound prefill throughput of one worker
    prefill_overhead_s: float = 0.02           # per prefill launch
    decode_s_per_token: float = 0.02           # TPOT
    h2d_bytes_per_s: float = 25e9              # host -> GPU (PCIe 5)
    disk_bytes_per_s: float = 4e9              # local NVMe -> host
    shared_bytes_per_s: float = 6e9            # shared store (RDMA/network) -> host
    max_batch: int = 32                        # running requests (prefill + decode)
    max_queue: int = 1024                      # waiting requests; beyond this /generate answers 503
    # Hybrid models (kvatlas worker --family): what a load-back moves besides the full-attention KV
    mamba_state_bytes: int = 0                 # one Mamba state (conv + temporal, every Mamba layer)
    window_bytes_per_token: int = 0            # sliding-window layers' KV per token (the window's pages)

    def load_s(self, host: int, disk: int, shared: int) -> float:
        """Virtual seconds to bring cached tokens to the GPU (tiers below host go through host)."""
        b = self.kv_bytes_per_token
        return (b * (host + disk + shared) / self.h2d_bytes_per_s + b * disk / self.disk_bytes_per_s
                + b * shared / self.shared_bytes_per_s)

    def load_bytes_s(self, nbytes: int, tier: str) -> float:
        """Virtual seconds to bring `nbytes` from `tier` (host, disk, shared) to the GPU."""
        s = nbytes / self.h2d_bytes_per_s
        if tier == "disk":
            s += nbytes / self.disk_bytes_per_s
        elif tier == "shared":
            s += nbytes / self.shared_bytes_per_s
        return s

    def prefill_s(self, computed: int) -> float:
        return self.prefill_overhead_s + computed / self.prefill_tokens_per_s


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


# --- router report --------------------------------------------------------------------------

class RequestRecord(Struct, omit_defaults=True):
    index: int
    worker_id: str
    input_tokens: int
    predicted_cached: Optional[int] = None   # tokens the policy expected served from cache (index or own guess)
    arrival_cached: Optional[int] = None     # the worker's truth at arrival
    served: Optional[Tokens] = None
    ttft_s: Optional[float] = None
    queue_s: Optional[float] = None
    error: Optional[str] = None
    predicted_pending: Optional[int] = None  # of predicted_cached: tokens of in-flight routes (pending_blocks)
    wait_s: Optional[float] = None           # wall seconds its forward waited for routes' admission (causal forwarding)
    wait_timeout: bool = False               # that wait ended at its deadline, some route not admitted


class RouterReport(Struct, omit_defaults=True):
    policy: str
    replica: int
    replicas: int
    records: list[RequestRecord]
    done: bool = True


class PolicyRow(Struct):
    """One row of the demo table (`--json` shape; the first eight fields are the stable contract)."""

    policy: str
    routers: int
    requests: int
    hit_ratio: float
    prefill_tokens: int
    ttft_mean_s: float
    ttft_p90_s: float
    prediction_accuracy: Optional[float]
    errors: int = 0
    index_behind: int = 0     # mismatches where the worker served more from cache than predicted
    index_ahead: int = 0      # mismatches where it served less
    # Measured causes of the mismatches (report.mismatch_cause): cause -> requests
    causes: dict[str, int] = msgspec.field(default_factory=dict)
    held_accuracy: Optional[float] = None  # predicted == what the worker held at arrival (second figure)
    # causal forwarding: requests whose forward waited for routes' admission, of them those that timed
    # out, and their wall-clock wait (median, largest; milliseconds)
    waits: int = 0
    wait_timeouts: int = 0
    wait_p50_ms: Optional[float] = None
    wait_max_ms: Optional[float] = None


json_encoder = msgspec.json.Encoder()
