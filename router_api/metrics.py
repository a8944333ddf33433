"""Our own counters, gauges and histograms, exposed through `prometheus_client`.

The metric objects stay ours (the ingest loop adds a whole poll's tally under one lock, which the
client library's per-sample objects cannot); `prometheus_client` renders them: each metric becomes
a MetricFamily in a custom collector and `generate_latest` writes the text format (escaping, float
formatting, `_total` / `_bucket` naming are the library's).

Data structures only: no clock, no I/O. Each metric has its own lock because the ingestion thread
and the HTTP thread both write (dict read-modify-write is not atomic across threads).
"""
from __future__ import annotations

import bisect
import math
import threading
from collections import deque
from typing import Any, Iterable, Iterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

LabelValues = tuple[str, ...]
__all__ = ["CONTENT_TYPE_LATEST", "Counter", "Gauge", "Histogram", "ServiceMetrics", "exposition"]


class _Collector:
    """A prometheus_client collector over our metric objects (read at scrape time)."""

    __slots__ = ("_metrics",)

    def __init__(self, metrics: Iterable["_Metric"]) -> None:
        self._metrics = tuple(metrics)

    def collect(self) -> Iterator[Any]:
        for m in self._metrics:
            yield m.family()


def exposition(metrics: Iterable["_Metric"]) -> str:
    """The Prometheus text format of `metrics`, written by prometheus_client."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(metrics))
    return generate_latest(registry).decode("utf-8")


class _Metric:
    __slots__ = ("name", "help", "labelnames", "_lock")
    kind = "untyped"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()

    def _check(self, labels: LabelValues) -> None:
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {labels}")

    def family(self) -> Any:
        raise NotImplementedError

    def render(self) -> list[str]:
        """This metric alone in the text format, one line per item."""
        return exposition([self]).splitlines()


class Counter(_Metric):
    __slots__ = ("_values", "_by_first")
    kind = "counter"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help, labelnames)
        self._values: dict[LabelValues, float] = {}
        # label sets by their first value (a worker's series), so `forget` costs that worker's series
        # rather than a pass over every worker's
        self._by_first: dict[str, set[LabelValues]] = {}

    def _new(self, labels: LabelValues) -> None:
        """A label set seen for the first time: checked once, and indexed by its first value."""
        self._check(labels)
        if labels:
            self._by_first.setdefault(labels[0], set()).add(labels)

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        with self._lock:
            v = self._values.get(labels)
            if v is None:  # labels are checked once per label set, not on every hot-path inc
                self._new(labels)
                v = 0.0
            self._values[labels] = v + amount

    def inc_many(self, amounts: dict[LabelValues, float]) -> None:
        """Add several label sets at once under one lock (the ingest loop's per-poll tally)."""
        with self._lock:
            values = self._values
            for labels, amount in amounts.items():
                v = values.get(labels)
                if v is None:
                    self._new(labels)
                    v = 0.0
                values[labels] = v + amount

    def get(self, *labels: str) -> float:
        return self._values.get(labels, 0.0)

    def forget(self, first: str) -> None:
        """Drop every series whose first label value is `first` (a removed worker's)."""
        with self._lock:
            for k in self._by_first.pop(first, ()):
                self._values.pop(k, None)

    def total(self) -> float:
        with self._lock:
            return sum(self._values.values())

    def items(self) -> list[tuple[LabelValues, float]]:
        with self._lock:
            return sorted(self._values.items())

    def family(self) -> Any:
        fam = CounterMetricFamily(self.name, self.help, labels=self.labelnames)
        for labels, v in self.items():
            fam.add_metric(labels, v)
        return fam


class Gauge(Counter):
    __slots__ = ()
    kind = "gauge"

    def set(self, *labels: str, value: float) -> None:
        with self._lock:
            if labels not in self._values:
                self._new(labels)
            self._values[labels] = value

    def set_many(self, values: dict[LabelValues, float]) -> None:
        with self._lock:
            for labels, value in values.items():
                if labels not in self._values:
                    self._new(labels)
                self._values[labels] = value

    def replace(self, values: dict[LabelValues, float]) -> None:
        """Swap in a fresh set of samples (e.g. per-worker gauges after a removal)."""
        with self._lock:
            self._values = dict(values)
            self._by_first = {}
            for labels in self._values:
                if labels:
                    self._by_first.setdefault(labels[0], set()).add(labels)

    def family(self) -> Any:
        fam = GaugeMetricFamily(self.name, self.help, labels=self.labelnames)
        for labels, v in self.items():
            fam.add_metric(labels, v)
        return fam


class Histogram(_Metric):
    __slots__ = ("buckets", "_counts", "_sums")
    kind = "histogram"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = (),
                 buckets: Iterable[float] = ()) -> None:
        super().__init__(name, help, labelnames)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._counts: dict[LabelValues, list[int]] = {}
        self._sums: dict[LabelValues, float] = {}

    def observe(self, value: float, *labels: str) -> None:
        i = bisect.bisect_left(self.buckets, value)
        with self._lock:
            counts = self._counts.get(labels)
            if counts is None:  # labels are checked once per label set (every /score observes)
                self._check(labels)
                counts = self._counts[labels] = [0] * len(self.buckets)
                self._sums[labels] = 0.0
            counts[i] += 1
            self._sums[labels] += value

    def count(self, *labels: str) -> int:
        return sum(self._counts.get(labels, ()))

    def family(self) -> Any:
        fam = HistogramMetricFamily(self.name, self.help, labels=self.labelnames)
        with self._lock:
            snap = sorted((k, list(v), self._sums[k]) for k, v in self._counts.items())
        for labels, counts, total in snap:
            acc = 0
            buckets = []
            for bound, c in zip(self.buckets, counts):
                acc += c
                buckets.append((floatToGoString(bound), acc))
            fam.add_metric(labels, buckets, total)
        return fam


class RecentWindow:
    """The last `maxlen` observations, for the dashboard's recent p50/p99 (not a Prometheus type)."""

    __slots__ = ("_values", "_lock")

    def __init__(self, maxlen: int = 1024) -> None:
        self._values: deque[float] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def add(self, v: float) -> None:
        self._values.append(v)  # deque.append is atomic under the GIL

    def quantiles(self, qs: Sequence[float]) -> list[float | None]:
        with self._lock:
            vals = sorted(self._values)
        if not vals:
            return [None for _ in qs]
        return [vals[min(len(vals) - 1, int(q * len(vals)))] for q in qs]

    def __len__(self) -> int:
        return len(self._values)


LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)


class ServiceMetrics:
    """Every metric the indexer service exposes, in one place."""

    __slots__ = (
        "events", "drops", "batches", "gaps", "replays", "resyncs", "restarts", "worker_lag",
        "worker_blocks", "request_latency", "http_rejects", "snapshots", "snapshot_requests",
        "recent_score", "index_core", "native_declines", "visibility", "score_answers", "offload_pending",
        "worker_drops", "_all",
    )

    def __init__(self) -> None:
        p = "kvatlas_"
        self.events = Counter(p + "events_applied_total", "KV events applied, by type, tier and outcome",
                              ("type", "tier", "outcome"))
        self.drops = Counter(p + "drops_total", "Events, batches or requests dropped, by reason", ("reason",))
        # Per worker: bounded by the registry (max_workers) and the reasons' fixed vocabulary, forgotten
        # with the worker (`forget_worker`). `drops_total` keeps what no registered worker owns too.
        self.worker_drops = Counter(p + "worker_drops_total", "Events of a registered worker dropped, by worker "
                                    "and reason (also in drops_total)", ("worker", "reason"))
        self.batches = Counter(p + "batches_total", "Batches received, by worker and kind", ("worker", "kind"))
        self.gaps = Counter(p + "gaps_total", "Sequence gaps detected, by worker", ("worker",))
        self.replays = Counter(p + "replays_total", "Gaps recovered by replay, by worker", ("worker",))
        self.resyncs = Counter(p + "resyncs_total", "Gaps replay could not cover (worker resynced)", ("worker",))
        self.restarts = Counter(p + "restarts_detected_total", "Publisher restarts detected", ("worker",))
        self.worker_lag = Gauge(p + "worker_lag_seconds", "Apply time minus publish time, last batch", ("worker",))
        self.worker_blocks = Gauge(p + "worker_blocks", "Blocks indexed per worker and tier", ("worker", "tier"))
        self.request_latency = Histogram(p + "request_seconds", "HTTP request latency by endpoint",
                                         ("endpoint",), LATENCY_BUCKETS)
        self.http_rejects = Counter(p + "http_rejects_total", "Rejected HTTP requests by endpoint and reason",
                                    ("endpoint", "reason"))
        self.snapshots = Counter(p + "snapshots_total", "Snapshots written or loaded, by outcome", ("outcome",))
        self.snapshot_requests = Counter(
            p + "snapshot_requests_total",
            "Resyncs that asked the worker's publisher to re-publish its state in-stream, by outcome "
            "(sent; not_sent: no replay endpoint or the send failed; error)", ("worker", "outcome"))
        self.recent_score = RecentWindow(2048)
        self.visibility = RecentWindow(4096)  # batch publish -> applied (visible to /score), seconds
        self.index_core = Gauge(p + "index_core", "1 for the index core in use: native (the C accelerator) "
                                "or python (the pure-Python reference core, several times slower)", ("core",))
        self.native_declines = Gauge(
            p + "native_declines", "Raw batches the C accelerator's whole-batch walk handed to the pure core "
            "since start, by reason (the answers are the same; the pure core is slower)", ("reason",))
        self.score_answers = Counter(
            p + "score_answers_total", "/score answers by writer: c (the native writer, in-flight rows included) "
            "or msgspec (pure core, hybrid models, input the C path defers)", ("writer",))
        self.offload_pending = Gauge(p + "http_offload_pending", "Large /score and /query bodies' answers queued "
                                     "or running off the event loop (router_api/offload.py)")
        self._all: tuple[_Metric, ...] = (
            self.index_core, self.native_declines, self.score_answers, self.offload_pending,
            self.events, self.drops, self.worker_drops, self.batches, self.gaps, self.replays, self.resyncs,
            self.restarts, self.worker_lag, self.worker_blocks, self.request_latency,
            self.http_rejects, self.snapshots, self.snapshot_requests,
        )

    def forget_worker(self, worker_id: str) -> None:
        """Remove a worker's per-worker series (its counters end with it: an id used again later
        starts from zero, as a new process would)."""
        for m in self._all:
            if m.labelnames[:1] == ("worker",) and isinstance(m, Counter):
                m.forget(worker_id)

    def totals(self) -> dict[str, Any]:
        """The counters' totals `GET /stats` (the dashboard) shows; rates are computed client-side."""
        by_type: dict[str, float] = {}
        for (typ, _tier, _outcome), n in self.events.items():
            by_type[typ] = by_type.get(typ, 0) + n
        p50, p99 = self.recent_score.quantiles((0.5, 0.99))
        return {
            "events_total": self.events.total(),
            "events_by_type": by_type,
            "batches_total": self.batches.total(),
            "drops": {labels[0]: n for labels, n in self.drops.items()},
            "gaps": self.gaps.total(), "replays": self.replays.total(), "resyncs": self.resyncs.total(),
            "restarts": self.restarts.total(), "snapshot_requests": self.snapshot_requests.total(),
            "score": {"count": self.request_latency.count("score"),
                      "p50_ms": None if p50 is None else p50 * 1e3,
                      "p99_ms": None if p99 is None else p99 * 1e3},
        }

    def render(self) -> str:
        return exposition(self._all)
