"""`kvatlas indexer --nats`: pending routes carried to every indexer replica (docs/CONTRACTS.md,
"Pending routes").

A route reported to (released at, admitted at) one replica is published on a core NATS subject as the
index's block keys (the same keys on every replica: the same hashing of the same model); every
other replica applies it to its own `RouteBook`. Routes are short-lived and rebuilt by the next
reports, so plain publish/subscribe (no stream) fits: a replica that misses one counts it nowhere
and lets the TTL or the worker's events settle it (a missed admission: a router waiting on that
replica for it times out, counted). Messages from this replica come back and are
skipped by origin. Received messages are applied by a private thread (the NATS callback only
queues them: it must never wait for the service lock).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Sequence
from typing import Any, Optional

import msgspec

from router_api.metrics import Counter

log = logging.getLogger("kvatlas.route_plane")

DEFAULT_ROUTES_SUBJECT = "kvatlas.routes"
_STOP = object()


class RouteMsg(msgspec.Struct, array_like=True, omit_defaults=True):
    origin: str
    op: str                    # "add" | "release" | "admit"
    model: str
    request_id: str
    worker_id: str = ""
    dp_rank: int = 0
    keys: list[int] = []
    tokens: int = -1           # the prompt's length ("add"; -1: not sent)
    busy_until: Optional[float] = None  # the reporting router's end-time estimate for the worker ("add")
    admits: bool = False       # its router reports the worker's admission of it ("add")


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(RouteMsg)


class RouteFanout:
    """Publishes this replica's route changes and applies the other replicas'."""

    __slots__ = ("nats", "service", "subject", "origin", "counts", "_jobs", "_thread", "_sub")

    def __init__(self, nats: Any, service: Any, subject: str = DEFAULT_ROUTES_SUBJECT) -> None:
        self.nats = nats
        self.service = service
        self.subject = subject
        self.origin = os.urandom(8).hex()
        self.counts = Counter("kvatlas_route_fanout_total",
                              "Pending-route changes carried between indexer replicas, by direction and outcome",
                              ("direction", "outcome"))
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvatlas-route-fanout", daemon=True)
        self._thread.start()
        jobs = self._jobs

        async def on_msg(msg: Any) -> None:
            jobs.put(msg.data)

        self._sub = nats.call(lambda: nats.nc.subscribe(subject, cb=on_msg))

    # -- out ---------------------------------------------------------------------------------
    def added(self, model: str, request_id: str, worker_id: str, dp_rank: int, keys: Sequence[int],
              tokens: int = -1, busy_until: float | None = None, admits: bool = False) -> None:
        self._send(RouteMsg(self.origin, "add", model, request_id, worker_id, dp_rank, list(keys), tokens,
                            busy_until, admits))

    def released(self, model: str, request_id: str) -> None:
        self._send(RouteMsg(self.origin, "release", model, request_id))

    def admitted(self, model: str, request_id: str) -> None:
        self._send(RouteMsg(self.origin, "admit", model, request_id))

    def _send(self, m: RouteMsg) -> None:
        data = _enc.encode(m)
        nc = self.nats.nc
        try:
            self.nats.submit(lambda: nc.publish(self.subject, data))
            self.counts.inc("out", m.op)
        except Exception as exc:  # the other replicas' TTLs and the worker's events settle it
            self.counts.inc("out", "error")
            log.warning("event=route_fanout_publish_failed error=%r", exc)

    # -- in ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            data = self._jobs.get()
            if data is _STOP:
                return
            try:
                m = _dec.decode(data)
            except msgspec.DecodeError:
                self.counts.inc("in", "bad")
                continue
            if m.origin == self.origin:
                continue
            try:
                if m.op == "add":
                    ok = self.service.apply_route(m.model, m.request_id, m.worker_id, m.dp_rank, m.keys,
                                                  None if m.tokens < 0 else m.tokens, m.busy_until, m.admits)
                    self.counts.inc("in", "add" if ok else "unknown_worker")
                elif m.op == "release":
                    self.service.release_route(m.model, m.request_id, fanout=False)
                    self.counts.inc("in", "release")
                elif m.op == "admit":
                    self.service.admit_route(m.model, m.request_id, fanout=False)
                    self.counts.inc("in", "admit")
                else:
                    self.counts.inc("in", "bad")
            except Exception as exc:  # one bad message must not stop the follower
                self.counts.inc("in", "error")
                log.error("event=route_fanout_apply_failed error=%r", exc)

    def metrics_text(self) -> str:
        return "\n".join(self.counts.render()) + "\n"

    def close(self) -> None:
        self._jobs.put(_STOP)
        self._thread.join(5.0)
        try:
            sub = self._sub
            self.nats.call(lambda: sub.unsubscribe(), timeout=2.0)
        except Exception:  # the connection may be closing already
            pass
