"""How an applied batch is counted: `ApplyAdapter` (the ingest loop's one door to the index and the
metrics), `Tally` (one poll's metric increments, flushed at once) and `record_apply_stats`. Plain data
and a seam, no thread of their own (router_api/ingest.py runs them)."""
from __future__ import annotations

from typing import Any

from indexer import reconcile
from indexer.protocol import Index
from router_api.metrics import ServiceMetrics


class ApplyAdapter:
    """How a decoded batch reaches the index and how its outcome is counted. Isolated here so the
    ingest loop does not depend on ApplyStats' exact shape."""

    __slots__ = ("index", "metrics")

    def __init__(self, index: Index, metrics: ServiceMetrics) -> None:
        self.index = index
        self.metrics = metrics

    def apply(self, model: str, worker_id: str, dp_rank: int, batch: Any) -> Any:
        return self.index.apply(model, worker_id, dp_rank, batch)

    def apply_payload(self, model: str, worker_id: str, dp_rank: int, payload: bytes) -> Any:
        """The batch's own dp_rank (else `dp_rank`), ts and event count come back in the stats."""
        return self.index.apply_payload(model, worker_id, dp_rank, payload, rank_from_batch=True)

    def record(self, stats: Any) -> tuple[bool, bool]:
        """Feed ApplyStats into metrics; returns (orphans expired, batch held AllBlocksCleared)."""
        return record_apply_stats(self.metrics, stats)


class Tally:
    """Metric increments of one poll's deliveries, added to `ServiceMetrics` in one go by `flush`
    (one lock per metric per poll instead of several per batch). Plain data; no I/O."""

    __slots__ = ("events", "drops", "worker_drops", "batches", "lag")

    def __init__(self) -> None:
        self.events: dict[tuple[str, ...], float] = {}
        self.drops: dict[tuple[str, ...], float] = {}
        self.worker_drops: dict[tuple[str, ...], float] = {}  # (worker, reason)
        self.batches: dict[tuple[str, ...], float] = {}
        self.lag: dict[tuple[str, ...], float] = {}  # last value per worker (a gauge)

    def add_stats(self, stats: Any) -> tuple[bool, bool]:
        """ApplyStats -> tallies; returns (orphans expired, the batch held an AllBlocksCleared)."""
        events = self.events
        for key, n in stats.counts.items():
            if n:
                events[key] = events.get(key, 0) + n
        if stats.drops:
            drops = self.drops
            for reason, n in stats.drops.items():
                if n:
                    k = (reason,)
                    drops[k] = drops.get(k, 0) + n
        return bool(stats.resync_needed), reconcile.cleared_in(stats.counts)

    def flush(self, metrics: ServiceMetrics) -> None:
        if self.events:
            metrics.events.inc_many(self.events)
            self.events = {}
        if self.drops:
            metrics.drops.inc_many(self.drops)
            self.drops = {}
        if self.worker_drops:
            metrics.worker_drops.inc_many(self.worker_drops)
            self.worker_drops = {}
        if self.batches:
            metrics.batches.inc_many(self.batches)
            self.batches = {}
        if self.lag:
            metrics.worker_lag.set_many(self.lag)
            self.lag = {}


def record_apply_stats(metrics: ServiceMetrics, stats: Any) -> tuple[bool, bool]:
    """ApplyStats (indexer.core.types) -> metrics. Returns (expired orphans — a parent never
    arrived, so the worker's view is incomplete —, the batch held an AllBlocksCleared)."""
    if stats is None:
        return False, False
    tally = Tally()
    out = tally.add_stats(stats)
    tally.flush(metrics)
    return out
