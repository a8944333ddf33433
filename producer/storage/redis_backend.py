"""L3 on a real Redis server: pipelined batches, binary values, optional TTL.

Connection failures never raise into the caller: the batch (or the rest of it) comes back as
False/None per key and is logged once per outage. A write is reported True only when Redis replied
OK to that very SET, so an outage can cost a backup but never produce a false `Stored` event.
redis-py reconnects lazily, so the backend recovers on its own when the server comes back.

Data loss detection (`track_keys`, default on): every pipeline reads a per-backend marker key
first and rewrites it last. A missing marker means the server lost its data since our previous
pipeline (restart without persistence, FLUSHALL, or the marker itself evicted) — every key this
backend had confirmed is then reported through `drain_evicted()`, so the fleet index does not keep
advertising blocks that are gone. The cost is one set entry per confirmed key.
"""
from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from .base import BytesLike, StorageCapacity, check_batch, copy_into

log = logging.getLogger(__name__)

_FAILURES = (redis.exceptions.RedisError, OSError)
_MARKER_TTL_S = 7 * 24 * 3600  # markers of dead processes expire on their own


class RedisStorageBackend:
    __slots__ = (
        "name", "shared", "prefix", "_ttl_ms", "_batch", "_r", "_db", "_down", "_lock",
        "_last_capacity", "failures", "_notify", "_pubsub", "_evicted", "_marker", "_tracked",
        "data_losses",
    )

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        prefix: str = "kvatlas:l3:",
        shared: bool = True,
        ttl_s: float | None = None,
        *,
        batch_size: int = 256,
        socket_timeout: float = 5.0,
        connect_timeout: float = 2.0,
        notify_evictions: bool = False,
        track_keys: bool = True,
        name: str | None = None,
    ) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError("ttl_s must be > 0 (or None for no expiry)")
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.name = name or f"redis:{url}"
        self.shared = bool(shared)
        self.prefix = prefix
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._batch = batch_size
        try:
            # one quick retry on a fresh connection: after a server restart the pooled socket is
            # dead, and the first command should not fail just because of that.
            self._r = redis.Redis.from_url(
                url,
                socket_timeout=socket_timeout,
                socket_connect_timeout=connect_timeout,
                retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), 1),
                health_check_interval=0,
            )
        except ValueError as exc:
            raise ValueError(f"bad Redis URL {url!r}: {exc}") from exc
        self._db = int(self._r.connection_pool.connection_kwargs.get("db", 0) or 0)
        self._down = False
        self._lock = threading.Lock()
        self._last_capacity = StorageCapacity(0, None)
        self.failures = 0
        self._notify = notify_evictions
        self._pubsub: redis.client.PubSub | None = None
        self._evicted: list[str] = []
        self._marker = f"{prefix}__kvatlas_epoch__:{uuid.uuid4().hex}"
        self._tracked: dict[str, None] | None = {} if track_keys else None  # insertion-ordered set
        self.data_losses = 0
        if notify_evictions:
            self._subscribe()

    # -- failure bookkeeping -----------------------------------------------------------------
    def _failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        if not self._down:
            self._down = True
            log.warning("Redis L3 %s: %s failed (%s); reporting misses until it recovers", self.name, what, exc)
        else:
            log.debug("Redis L3 %s: %s failed (%s)", self.name, what, exc)

    def _ok(self) -> None:
        if self._down:
            self._down = False
            log.info("Redis L3 %s: reachable again", self.name)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _chunks(self, n: int) -> range:
        return range(0, n, self._batch)

    def _pipeline(self) -> redis.client.Pipeline:
        pipe = self._r.pipeline(transaction=False)
        if self._tracked is not None:
            pipe.get(self._marker)
        return pipe

    def _execute(self, pipe: redis.client.Pipeline, what: str) -> list[object] | None:
        """Run a pipeline built by `_pipeline`; the body's replies, or None when the server is
        unreachable. Handles the data-loss marker around the body."""
        if self._tracked is not None:
            pipe.set(self._marker, b"1", ex=_MARKER_TTL_S)
        try:
            replies = pipe.execute(raise_on_error=False)
        except _FAILURES as exc:
            self._failed(what, exc)
            return None
        self._ok()
        if self._tracked is None:
            return replies
        if replies[0] is None and self._tracked:
            self.data_losses += 1
            log.warning(
                "Redis L3 %s lost its data (restart/flush); reporting %d stored keys as evicted",
                self.name, len(self._tracked),
            )
            self._evicted.extend(self._tracked)
            self._tracked.clear()
        return replies[1:-1]

    # -- StorageBackend ----------------------------------------------------------------------
    def set(self, keys: Sequence[str], values: Sequence[BytesLike]) -> list[bool]:
        check_batch(keys, values)
        out = [False] * len(keys)
        with self._lock:
            mark = len(self._evicted)
            for lo in self._chunks(len(keys)):
                hi = min(lo + self._batch, len(keys))
                pipe = self._pipeline()
                for i in range(lo, hi):
                    pipe.set(self._k(keys[i]), _wire_value(values[i]), px=self._ttl_ms)
                replies = self._execute(pipe, "SET batch")
                if replies is None:
                    break  # server unreachable: don't wait out a timeout per remaining chunk
                for i, reply in zip(range(lo, hi), replies):
                    if reply is True:
                        out[i] = True
                        if self._tracked is not None:
                            self._tracked[keys[i]] = None
                    else:
                        self.failures += 1
                        log.warning("Redis L3 SET %r refused: %s", keys[i], reply)
            if len(self._evicted) > mark:
                # a loss detected during this call does not apply to keys this call re-stored
                stored = {k for k, ok in zip(keys, out) if ok}
                self._evicted[mark:] = [k for k in self._evicted[mark:] if k not in stored]
            self._collect_notifications()
        return out

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        check_batch(keys)
        out: list[bytes | None] = [None] * len(keys)
        with self._lock:
            for lo in self._chunks(len(keys)):
                hi = min(lo + self._batch, len(keys))
                pipe = self._pipeline()
                pipe.mget([self._k(k) for k in keys[lo:hi]])
                replies = self._execute(pipe, "MGET")
                if replies is None:
                    break
                values = replies[0]
                if isinstance(values, list):
                    out[lo:hi] = [r if isinstance(r, bytes) else None for r in values]
        return out

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        if len(buffers) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        return copy_into(self.get(keys), buffers)

    def knows(self, keys: list[str]) -> list[bool] | None:
        """None: the server's contents are not known locally."""
        return None

    def exists(self, keys: Sequence[str]) -> list[bool]:
        check_batch(keys)
        out = [False] * len(keys)
        with self._lock:
            for lo in self._chunks(len(keys)):
                hi = min(lo + self._batch, len(keys))
                pipe = self._pipeline()
                for k in keys[lo:hi]:
                    pipe.exists(self._k(k))
                replies = self._execute(pipe, "EXISTS batch")
                if replies is None:
                    break
                out[lo:hi] = [r == 1 for r in replies]
        return out

    def delete(self, keys: Sequence[str]) -> int:
        check_batch(keys)
        n = 0
        with self._lock:
            for lo in self._chunks(len(keys)):
                chunk = keys[lo : lo + self._batch]
                pipe = self._pipeline()
                pipe.delete(*[self._k(k) for k in chunk])
                replies = self._execute(pipe, "DEL")
                if replies is None:
                    break
                if self._tracked is not None:
                    for k in chunk:
                        self._tracked.pop(k, None)
                if isinstance(replies[0], int):
                    n += replies[0]
        return n

    def capacity(self) -> StorageCapacity:
        """Server-wide memory use and `maxmemory` (None when unlimited); the last known figures
        while the server is unreachable."""
        with self._lock:
            try:
                info = self._r.info("memory")
            except _FAILURES as exc:
                self._failed("INFO", exc)
                return self._last_capacity
            self._ok()
            limit = int(info.get("maxmemory", 0) or 0)
            self._last_capacity = StorageCapacity(int(info.get("used_memory", 0)), limit or None)
            return self._last_capacity

    # -- expiry / eviction notifications (optional) ------------------------------------------
    def _subscribe(self) -> None:
        """Ask Redis for keyevent notifications of expired/evicted keys (best effort: a managed
        server may forbid CONFIG SET, and pub/sub messages sent while disconnected are lost)."""
        try:
            current = self._r.config_get("notify-keyspace-events").get("notify-keyspace-events") or ""
            flags = set(current) | {"E", "x", "e"}
            if set(current) != flags:
                self._r.config_set("notify-keyspace-events", "".join(sorted(flags)))
            ps = self._r.pubsub(ignore_subscribe_messages=True)
            ps.subscribe(f"__keyevent@{self._db}__:expired", f"__keyevent@{self._db}__:evicted")
            self._pubsub = ps
        except _FAILURES as exc:
            self._failed("eviction notification setup", exc)
            self._pubsub = None

    def _collect_notifications(self) -> None:
        if not self._notify:
            return
        if self._pubsub is None:
            self._subscribe()
            if self._pubsub is None:
                return
        try:
            while True:
                msg = self._pubsub.get_message(timeout=0.0)
                if msg is None:
                    break
                data = msg.get("data")
                if isinstance(data, bytes):
                    key = data.decode("utf-8", "replace")
                    if key.startswith(self.prefix) and key != self._marker:
                        k = key[len(self.prefix) :]
                        self._evicted.append(k)
                        if self._tracked is not None:
                            self._tracked.pop(k, None)
        except _FAILURES as exc:
            self._failed("notification read", exc)
            try:
                self._pubsub.close()
            except _FAILURES:
                pass
            self._pubsub = None

    def drain_evicted(self) -> list[str]:
        """Keys this backend confirmed that the server has since lost: all of them after a detected
        data loss (`track_keys`), and individual TTL expiries/evictions with `notify_evictions`
        (otherwise those surface as misses on `exists`/`get`)."""
        with self._lock:
            self._collect_notifications()
            out, self._evicted = self._evicted, []
        return out

    def close(self) -> None:
        with self._lock:
            if self._pubsub is not None:
                try:
                    self._pubsub.close()
                except _FAILURES:
                    pass
                self._pubsub = None
            try:
                self._r.close()
            except _FAILURES:
                pass


def _wire_value(v: BytesLike) -> bytes | memoryview:
    """redis-py sends bytes and memoryviews as-is (no copy of host pages)."""
    if isinstance(v, bytes):
        return v
    if isinstance(v, memoryview):
        return v.cast("B") if v.format != "B" or v.ndim != 1 else v
    return bytes(v)
