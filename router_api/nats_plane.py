"""`kvatlas indexer --nats URL`: the JetStream half of one indexer replica (docs/jetstream.md).

One NATS connection serves three things:
- the ingest subscriber: `RoutedSubscriber(Subscriber(...), JetStreamSubscriber(..., shared=True))`,
  so `jetstream:` workers are read from the stream and the rest over ZeroMQ;
- the shared registry (a NATS KV bucket): every replica follows it, so a `POST /workers` or
  `DELETE /workers/{id}` on one replica is carried out by all; the API handlers write it through
  `NatsPlane.publish` / `withdraw` (the app calls them when `service.plane` is set);
- the `/metrics` lines of the plane: consumer lag, duplicates, gaps, queue bounds, stream size.

Registrations seen in the bucket are applied by a private thread (the watch callbacks run on the
NATS loop and only queue them): unknown worker -> `service.register(reg)` (from the start of its
stream, or from the snapshot watermark when the replica restored it); changed registration ->
unregister + register; deleted -> unregister. Applying the bucket twice changes nothing, so a
replica seeing its own writes come back is harmless.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from indexer.jetstream_subscriber import JetStreamSubscriber
from indexer.routed_subscriber import RoutedSubscriber
from indexer.shared_registry import SharedRegistry
from router_api.metrics import Counter, Gauge, exposition
from router_api.registry import RegistryError
from schemas.api import RegisterWorker
from schemas.jetstream import DEFAULT_KV_BUCKET, StreamSettings
from transport.natsio import NatsThread

log = logging.getLogger("kvatlas.nats_plane")

_STOP = object()


class SharedRegistryUnavailable(RegistryError):
    """The registration could not be written to the shared registry (HTTP 503); this replica
    undid its own part so that the replicas keep agreeing."""

    status = 503


class NatsPlane:
    """Owns the NATS connection, the shared-registry follower thread and the plane's metrics."""

    __slots__ = ("url", "settings", "bucket", "shared", "nats", "registry", "js", "_service", "_jobs",
                 "_thread", "_lock", "applied", "errors", "_stream_cache", "static_ids")

    def __init__(self, url: str, *, stream: StreamSettings | None = None, bucket: str = DEFAULT_KV_BUCKET,
                 shared: bool = True) -> None:
        self.url = url
        self.settings = stream or StreamSettings()
        self.bucket = bucket
        self.shared = shared
        self.nats = NatsThread(url, name="kvatlas-indexer-nats")
        try:
            self.registry = SharedRegistry(self.nats, bucket)
        except Exception:
            self.nats.close()
            raise
        self.js: JetStreamSubscriber | None = None  # made on the ingest thread by the factory
        self._service: Any = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.applied = Counter("kvatlas_shared_registry_applied_total",
                               "Shared-registry changes this replica carried out, by operation", ("op",))
        self.errors = Counter("kvatlas_shared_registry_errors_total",
                              "Shared-registry writes or applies that failed, by operation", ("op",))
        self._stream_cache: tuple[float, dict[str, int] | None] = (0.0, None)
        self.static_ids: set[str] = set()  # configured workers: kept even when the bucket lacks them

    # -- the ingest subscriber ---------------------------------------------------------------
    def subscriber_factory(self, replay_timeout_s: float = 2.0) -> Callable[[], RoutedSubscriber]:
        def make() -> RoutedSubscriber:
            from indexer.subscriber import Subscriber

            js = JetStreamSubscriber(self.nats, stream=self.settings, shared=self.shared, max_per_poll=1024)
            self.js = js
            return RoutedSubscriber(Subscriber(replay_timeout=replay_timeout_s, max_per_poll=1024, runs=True), js)

        return make

    # -- the shared registry -----------------------------------------------------------------
    def attach(self, service: Any) -> None:
        """Follow the bucket into `service` (started). Workers the replica restored from its
        snapshot but the bucket no longer holds (deleted while it was down) are dropped first."""
        self._service = service
        self.static_ids = {r.worker_id for r in service.config.static_workers}
        present = {r.worker_id for r in self.registry.list()}
        for w in list(service.registry):
            if w.worker_id not in present and w.worker_id not in self.static_ids:
                self._unregister(w.worker_id, "not_in_shared_registry")
        self._thread = threading.Thread(target=self._run, name="kvatlas-shared-registry", daemon=True)
        self._thread.start()
        jobs = self._jobs
        self.registry.watch(lambda reg: jobs.put(("put", reg)), lambda wid: jobs.put(("delete", wid)))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            op, arg = job
            try:
                if op == "put":
                    self._apply_put(arg)
                else:
                    self._unregister(arg, "shared_registry")
            except Exception as exc:  # one bad entry must not stop following the bucket
                self.errors.inc("apply_" + op)
                log.error("event=shared_registry_apply_failed op=%s error=%r", op, exc)

    def _apply_put(self, reg: RegisterWorker) -> None:
        service = self._service
        with self._lock:
            cur = service.registry.get(reg.worker_id)
            if cur is not None and cur.reg == reg:
                return  # already so (restored from the snapshot, or our own write coming back)
            try:
                if cur is not None:
                    # judged first: an entry that cannot be registered must not remove the live worker
                    service.check_replacement(reg)
                    service.unregister(reg.worker_id, reason="shared_registry_changed")
                service.register(reg)
            except RegistryError as exc:
                self.errors.inc("apply_put")
                log.error("event=shared_registry_rejected worker=%s error=%s", reg.worker_id, exc)
                return
        self.applied.inc("put")

    def _unregister(self, worker_id: str, reason: str) -> None:
        with self._lock:
            if worker_id not in self._service.registry:
                return
            try:
                self._service.unregister(worker_id, reason=reason)
            except RegistryError:
                return  # gone in between (expired)
        self.applied.inc("delete")

    def publish(self, reg: RegisterWorker) -> None:
        """Write a registration this replica accepted (POST /workers). On failure the local
        registration is undone and `SharedRegistryUnavailable` raised."""
        try:
            self.registry.put(reg)
        except Exception as exc:
            self.errors.inc("put")
            try:
                self._service.unregister(reg.worker_id, reason="shared_registry_unavailable")
            except RegistryError:
                pass
            raise SharedRegistryUnavailable(f"worker {reg.worker_id!r} not registered: the shared registry "
                                            f"at {self.url} could not be written ({exc!r})") from exc

    def withdraw(self, worker_id: str) -> None:
        """Delete a registration this replica removed (DELETE /workers/{id})."""
        try:
            self.registry.delete(worker_id)
        except Exception as exc:
            self.errors.inc("delete")
            raise SharedRegistryUnavailable(f"worker {worker_id!r} was removed here, but not from the shared "
                                            f"registry at {self.url} ({exc!r}); other replicas keep it") from exc

    # -- metrics -----------------------------------------------------------------------------
    def stream_state(self, max_age_s: float = 1.0) -> dict[str, int] | None:
        """The stream's size, cached briefly (one server round trip per scrape at most)."""
        at, state = self._stream_cache
        now = time.monotonic()
        if state is not None and now - at < max_age_s:
            return state
        js = self.js
        if js is None:
            return None
        try:
            state = js.stream_state()
        except Exception as exc:
            self.errors.inc("stream_info")
            log.warning("event=stream_info_failed error=%r", exc)
            return None
        self._stream_cache = (now, state)
        return state

    def metrics_text(self) -> str:
        """Prometheus lines of the plane (appended to the service's /metrics)."""
        p = "kvatlas_jetstream_"
        out: list[Any] = [self.applied, self.errors]
        bad = Gauge("kvatlas_shared_registry_bad_values", "Bucket values that did not decode (skipped)")
        bad.set(value=float(self.registry.bad_values))
        out.append(bad)
        js = self.js
        if js is not None:
            try:
                out += self._consumer_metrics(js, p)
            except (RuntimeError, KeyError) as exc:  # membership changed while we read it: next scrape
                log.debug("event=plane_metrics_skipped error=%r", exc)
            state = self.stream_state()
            if state is not None:
                stream = Gauge(p + "stream", "The events stream: messages, bytes, first/last seq, consumers",
                               ("field",))
                for k, v in state.items():
                    stream.set(k, value=float(v))
                out.append(stream)
        conn = Counter("kvatlas_nats_connection_total", "NATS connection events", ("event",))
        conn.inc("reconnects", amount=float(self.nats.reconnects))
        conn.inc("errors", amount=float(self.nats.errors))
        out.append(conn)
        return exposition(out)

    @staticmethod
    def _consumer_metrics(js: JetStreamSubscriber, p: str) -> list[Any]:
        lag = Gauge(p + "consumer_lag_messages", "Messages the server still holds for this replica, "
                    "by worker (shared consumer: its whole backlog)", ("worker",))
        for wid, n in js.consumer_lag().items():
            lag.set(wid, value=float(n))
        mark = Gauge(p + "watermark", "Stream sequence of the last message applied, by worker", ("worker",))
        for wid in js.workers():
            m = js.watermark(wid)
            if m is not None:
                mark.set(wid, value=float(m))
        st = js.stats
        counts = Counter(p + "messages_total", "Messages read from the stream, by outcome", ("outcome",))
        for name in ("received", "duplicates", "bad_frames", "replay_batches", "gaps_unrecovered", "restarts"):
            counts.inc(name, amount=float(getattr(st, name)))
        bounds = Counter(p + "backpressure_total", "In-process queue full waits and slow-consumer restarts "
                         "(re-reads from the watermark)", ("kind",))
        bounds.inc("queue_full_waits", amount=float(st.queue_full_waits))
        bounds.inc("slow_consumer_restarts", amount=float(st.slow_consumer_restarts))
        queued = Gauge(p + "queued_messages", "Messages received and not yet applied (bounded)")
        queued.set(value=float(js.queued))
        return [lag, mark, counts, bounds, queued]

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(_STOP)
            self._thread.join(5.0)
        self.registry.close()
        self.nats.close()


def plane_from_args(args: Any) -> NatsPlane:
    """The plane `kvatlas indexer --nats URL [--nats-stream S] [--nats-registry-bucket B]
    [--nats-per-worker]` asks for (raises `NatsUnavailable` naming the URL)."""
    return NatsPlane(args.nats, stream=StreamSettings(name=args.nats_stream), bucket=args.nats_registry_bucket,
                     shared=not args.nats_per_worker)
