"""Per-worker operator gauges on the indexer's `/metrics`, beside router_api/metrics.py's:
each worker's status (one series per status, 1 for the current one), seconds since its last
message, and registrations refused (by worker id and reason, e.g. a block size that conflicts with
its model's). Plain data; the service feeds it from its `/workers` rows."""
from __future__ import annotations

from typing import Iterable

from router_api.metrics import Counter, Gauge, exposition
from schemas.api import WORKER_STATUSES, WorkerStatus

MAX_REFUSED_IDS = 256  # a spray of bad registrations must not grow the label set without bound


class WorkerGauges:
    __slots__ = ("status", "silent", "refused")

    def __init__(self) -> None:
        self.status = Gauge("kvatlas_worker_status", "1 for each registered worker's current status "
                            "(connecting, live, stale, resyncing)", ("worker", "status"))
        self.silent = Gauge("kvatlas_worker_seconds_since_last_event",
                            "Seconds since the worker's last message (events or heartbeat); absent before the first",
                            ("worker",))
        self.refused = Counter("kvatlas_registrations_refused_total",
                               "Worker registrations refused, by worker id and reason (e.g. block_size_conflict)",
                               ("worker", "reason"))

    def refuse(self, worker_id: str, reason: str) -> None:
        known = {labels[0] for labels, _ in self.refused.items()}
        if worker_id not in known and len(known) >= MAX_REFUSED_IDS:
            worker_id = "_other"
        self.refused.inc(worker_id, reason)

    def update(self, rows: Iterable[WorkerStatus]) -> None:
        status: dict[tuple[str, ...], float] = {}
        silent: dict[tuple[str, ...], float] = {}
        for r in rows:
            for s in WORKER_STATUSES:
                status[(r.worker_id, s)] = 1.0 if r.status == s else 0.0
            if r.silent_s is not None:
                silent[(r.worker_id,)] = r.silent_s
        self.status.replace(status)
        self.silent.replace(silent)

    def render(self) -> str:
        return exposition((self.status, self.silent, self.refused))
