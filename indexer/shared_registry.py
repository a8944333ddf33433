"""Worker registrations shared by every indexer replica: a NATS KV bucket (docs/jetstream.md).

Key = the worker id (`schemas.jetstream.kv_key`, reversible escaping); value = the
`schemas.api.RegisterWorker` as JSON. `put` on one replica (its `POST /workers`) is seen by every
replica's `watch`; `delete` likewise. A value that does not decode is counted and logged, never
raised into a watcher.

`watch(on_put, on_delete)` first replays the current entries, then follows changes; callbacks run
on the NATS loop thread and must only hand work over (e.g. `IngestLoop.subscribe`, which queues).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec
from nats.js import api
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NoKeysError

from transport.natsio import NatsThread
from schemas.api import RegisterWorker
from schemas.jetstream import DEFAULT_KV_BUCKET, kv_key, kv_key_name

log = logging.getLogger(__name__)

_decoder = msgspec.json.Decoder(RegisterWorker)


def decode_registration(value: bytes) -> RegisterWorker | str:
    try:
        return _decoder.decode(value)
    except msgspec.MsgspecError as exc:
        return str(exc)


class SharedRegistry:
    """Registrations in one KV bucket (created when missing)."""

    __slots__ = ("_nats", "_own_nats", "bucket", "_kv", "bad_values", "_watchers", "_closed")

    def __init__(self, nats: str | NatsThread, bucket: str = DEFAULT_KV_BUCKET, *, history: int = 1,
                 replicas: int = 1) -> None:
        self._own_nats = isinstance(nats, str)
        self._nats = NatsThread(nats, name="kvatlas-registry") if isinstance(nats, str) else nats
        self.bucket = bucket
        self.bad_values = 0
        self._watchers: list[Any] = []
        self._closed = False
        try:
            self._kv = self._nats.call(lambda: self._open(history, replicas))
        except Exception:
            if self._own_nats:
                self._nats.close()
            raise

    async def _open(self, history: int, replicas: int) -> Any:
        js = self._nats.js
        assert js is not None
        try:
            return await js.key_value(self.bucket)
        except BucketNotFoundError:
            return await js.create_key_value(api.KeyValueConfig(bucket=self.bucket, history=history,
                                                                replicas=replicas))

    def put(self, reg: RegisterWorker) -> int:
        """Store (or replace) a registration; returns its revision."""
        value = msgspec.json.encode(reg)
        return self._nats.call(lambda: self._kv.put(kv_key(reg.worker_id), value))

    def delete(self, worker_id: str) -> bool:
        """Remove a registration; False when there was none."""
        if self.get(worker_id) is None:
            return False
        self._nats.call(lambda: self._kv.delete(kv_key(worker_id)))
        return True

    def get(self, worker_id: str) -> RegisterWorker | None:
        async def read() -> bytes | None:
            try:
                entry = await self._kv.get(kv_key(worker_id))
            except KeyNotFoundError:
                return None
            return entry.value

        raw = self._nats.call(read)
        if not raw:
            return None
        reg = decode_registration(raw)
        if isinstance(reg, str):
            self._bad(worker_id, reg)
            return None
        return reg

    def list(self) -> list[RegisterWorker]:
        """Every valid registration (bad values are counted and skipped)."""
        async def keys() -> list[str]:
            try:
                return list(await self._kv.keys())
            except NoKeysError:
                return []

        out: list[RegisterWorker] = []
        for key in self._nats.call(keys):
            reg = self.get(kv_key_name(key))
            if reg is not None:
                out.append(reg)
        return out

    def watch(self, on_put: Callable[[RegisterWorker], None], on_delete: Callable[[str], None]) -> None:
        """Current entries, then every change, delivered to the callbacks on the loop thread."""
        async def start() -> Any:
            async def on_msg(msg: Any) -> None:
                key = msg.subject[len(f"$KV.{self.bucket}."):]
                try:
                    worker_id = kv_key_name(key)
                except ValueError:
                    self._bad(key, "undecodable key")
                    return
                op = (msg.headers or {}).get("KV-Operation")
                try:
                    if op in ("DEL", "PURGE"):
                        on_delete(worker_id)
                        return
                    reg = decode_registration(msg.data)
                    if isinstance(reg, str):
                        self._bad(worker_id, reg)
                    elif reg.worker_id != worker_id:
                        self._bad(worker_id, f"value names worker {reg.worker_id!r}")
                    else:
                        on_put(reg)
                except Exception:  # a callback bug must not stop the watch
                    log.exception("registry watcher callback failed for %s", worker_id)

            js = self._nats.js
            assert js is not None
            return await js.subscribe(f"$KV.{self.bucket}.>", stream=f"KV_{self.bucket}", cb=on_msg,
                                      ordered_consumer=True,
                                      deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT)

        self._watchers.append(self._nats.call(start))

    def _bad(self, worker_id: str, why: str) -> None:
        self.bad_values += 1
        log.warning("registry bucket %s: dropped registration %r: %s", self.bucket, worker_id, why)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sub in self._watchers:
            try:
                self._nats.call(sub.unsubscribe, timeout=5.0)
            except Exception as exc:
                log.debug("unsubscribe failed: %r", exc)
        if self._own_nats:
            self._nats.close()

    def __enter__(self) -> SharedRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
