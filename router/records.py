"""What a router records per request and reports: the replay report a `kvatlas router` writes and
the demo table's rows (`kvatlas demo --json`). msgspec only."""
from __future__ import annotations

from typing import Optional

import msgspec
from msgspec import Struct

from sim.api import Tokens


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

