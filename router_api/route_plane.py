"""`kvatlas indexer --nats`: pending routes carried to every indexer replica (docs/CONTRACTS.md,
"Pending routes"; docs/reference.md, "Security").

A route reported to (released at, admitted at) one replica is published on a core NATS subject as the
index's block keys (the same keys on every replica: the same hashing of the same model); every
other replica applies it to its own `RouteBook`. Routes are short-lived and rebuilt by the next
reports, so plain publish/subscribe (no stream) fits: a replica that misses one counts it nowhere
and lets the TTL or the worker's events settle it (a missed admission: a router waiting on that
replica for it times out, counted). Messages from this replica come back and are skipped by origin.

The subject is a door into every replica, so what comes through it is judged like an HTTP body:
- authenticated: with a shared secret (`KVATLAS_ROUTE_SECRET`, the same on every replica) each
  message carries an HMAC-SHA256 over its bytes and a send time; one without a valid MAC, or sent
  more than `MAX_SKEW_S` away from this replica's clock, is dropped (counted) before it is decoded.
  NATS permissions keep everyone but the replicas off the subject (docs/reference.md);
- validated with the HTTP schema's bounds (names, dp_rank, token count, a finite `busy_until` within
  ±1e12, keys u64), a bad one counted and dropped;
- bounded: received messages wait in a queue of `MAX_QUEUED` (beyond it: dropped, counted) for the
  private thread that applies them (the NATS callback must never wait for the service lock).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Optional

import msgspec
from msgspec import Meta

from router_api.metrics import Counter, Gauge
from schemas.api import MAX_QUERY_TOKENS, Name

log = logging.getLogger("kvatlas.route_plane")

DEFAULT_ROUTES_SUBJECT = "kvatlas.routes"
SECRET_ENV = "KVATLAS_ROUTE_SECRET"
MAX_QUEUED = 8192   # received messages not yet applied
MAX_SKEW_S = 30.0   # a signed message's send time must be this close to ours
_STOP = object()
_MAC = 32
_TS = struct.Struct(">d")

Key = Annotated[int, Meta(ge=0)]  # u64: msgpack holds no larger int


class RouteMsg(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=True):
    origin: Annotated[str, Meta(min_length=1, max_length=64)]
    op: Literal["add", "release", "admit"]
    model: Name
    request_id: Name
    worker_id: Annotated[str, Meta(max_length=256)] = ""
    dp_rank: Annotated[int, Meta(ge=0, le=1 << 16)] = 0
    keys: Annotated[list[Key], Meta(max_length=MAX_QUERY_TOKENS)] = []
    tokens: Annotated[int, Meta(ge=-1, le=MAX_QUERY_TOKENS)] = -1  # the prompt's length ("add"; -1: not sent)
    # the reporting router's end-time estimate for the worker ("add"), the HTTP schema's bounds
    busy_until: Optional[Annotated[float, Meta(ge=-1e12, le=1e12)]] = None
    admits: bool = False       # its router reports the worker's admission of it ("add")


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(RouteMsg)


def secret_from_env() -> bytes | None:
    value = os.environ.get(SECRET_ENV, "")
    return value.encode() if value else None


def seal(secret: bytes | None, payload: bytes, now: float) -> bytes:
    """The bytes published: with a secret, MAC(secret, send time + payload) + send time + payload."""
    if secret is None:
        return payload
    body = _TS.pack(now) + payload
    return hmac.new(secret, body, hashlib.sha256).digest() + body


def unseal(secret: bytes | None, data: bytes, now: float) -> bytes | str:
    """The payload of a received message, or why it is refused ("unauthenticated" / "stale")."""
    if secret is None:
        return data
    if len(data) < _MAC + _TS.size:
        return "unauthenticated"
    body = data[_MAC:]
    if not hmac.compare_digest(data[:_MAC], hmac.new(secret, body, hashlib.sha256).digest()):
        return "unauthenticated"
    sent = _TS.unpack_from(body)[0]
    if not abs(now - sent) <= MAX_SKEW_S:
        return "stale"
    return body[_TS.size:]


class RouteFanout:
    """Publishes this replica's route changes and applies the other replicas'."""

    __slots__ = ("nats", "service", "subject", "origin", "secret", "counts", "queued", "_jobs", "_thread", "_sub")

    def __init__(self, nats: Any, service: Any, subject: str = DEFAULT_ROUTES_SUBJECT,
                 secret: bytes | None = None, max_queued: int = MAX_QUEUED) -> None:
        self.nats = nats
        self.service = service
        self.subject = subject
        self.origin = os.urandom(8).hex()
        self.secret = secret if secret is not None else secret_from_env()
        if self.secret is not None:  # every replica names a waitable route alike (RouteBook.handle_key)
            service.routes.handle_key = hmac.new(self.secret, b"kvatlas route handles", hashlib.sha256).digest()
        else:
            log.warning("event=route_plane_unauthenticated subject=%s hint=set %s on every replica and restrict "
                        "the subject with NATS permissions (docs/reference.md)", subject, SECRET_ENV)
        self.counts = Counter("kvatlas_route_fanout_total",
                              "Pending-route changes carried between indexer replicas, by direction and outcome",
                              ("direction", "outcome"))
        self.queued = Gauge("kvatlas_route_fanout_queued", "Received route changes not yet applied (bounded)")
        self._jobs: queue.Queue[Any] = queue.Queue(max_queued)
        self._thread = threading.Thread(target=self._run, name="kvatlas-route-fanout", daemon=True)
        self._thread.start()
        jobs, counts, secret = self._jobs, self.counts, self.secret

        async def on_msg(msg: Any) -> None:  # on the NATS loop: judge the MAC, queue, never block
            payload = unseal(secret, msg.data, time.time())
            if isinstance(payload, str):
                counts.inc("in", payload)
                return
            try:
                jobs.put_nowait(payload)
            except queue.Full:
                counts.inc("in", "queue_full")

        self._sub = nats.call(lambda: nats.nc.subscribe(subject, cb=on_msg, pending_msgs_limit=4 * max_queued,
                                                        pending_bytes_limit=64 * 1024 * 1024))

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
        data = seal(self.secret, _enc.encode(m), time.time())
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
            except msgspec.DecodeError:  # ValidationError too: the HTTP schema's bounds
                self.counts.inc("in", "bad")
                continue
            if m.origin == self.origin:
                continue
            try:
                if m.op == "add" and m.worker_id:
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
        self.queued.set(value=float(self._jobs.qsize()))
        return "\n".join(self.counts.render() + self.queued.render()) + "\n"

    def close(self) -> None:
        while True:  # a full queue: what is left unapplied goes, the stop gets in
            try:
                self._jobs.put_nowait(_STOP)
                break
            except queue.Full:
                try:
                    self._jobs.get_nowait()
                except queue.Empty:
                    pass
        self._thread.join(5.0)
        try:
            sub = self._sub
            self.nats.call(lambda: sub.unsubscribe(), timeout=2.0)
        except Exception:  # the connection may be closing already
            pass
