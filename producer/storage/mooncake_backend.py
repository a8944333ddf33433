"""L3 on Mooncake Store (`MooncakeDistributedStore`): one pool of memory the fleet shares.

Configured like SGLang's Mooncake backend: `master_server_address`, `metadata_server`,
`local_hostname`, `protocol` (tcp | rdma), `device_name`, `global_segment_size` (the memory this
client contributes to the pool) and `local_buffer_size`. Keys are `prefix + key`, so several
fleets (or tests) can share one master.

Writes are zero-copy: each value's own memory (a view of a host page) goes to `batch_put_from` by
address; `get_into` reads straight into the caller's buffers (`batch_get_into`). A write is
reported True only for a key whose put returned 0, so a `Stored(EXTERNAL)` event always follows
the master's confirmation.

Capacity and evictions (docs/producer-l3.md "Mooncake"): the master evicts under memory pressure
without telling its clients, so the producer owns capacity and audits what it claims:
- `capacity_bytes`: this worker's share of the pool. A write that would exceed it first removes
  this backend's least recently used keys outside the batch and reports them through
  `drain_evicted()`; a batch the share cannot hold writes its head, and a claimed key whose
  rewrite is refused keeps its bytes counted (the claims never exceed the share). With the
  shares summing below the master's `eviction_high_watermark_ratio` the master never evicts on
  its own, and every removal is an event.
- The audit: every `audit_interval_s`, `batch_is_exist` on the next `audit_batch` keys this
  backend claims (round robin). A key the store no longer holds (the master evicted it, another
  worker removed it, the master restarted empty) is reported evicted. The index's shared tier is
  therefore stale for at most ceil(claimed / audit_batch) * audit_interval_s (plus one poll).
- A read that finds a claimed key absent reports it at once.
Every lookup (a read, an existence check) leases the object for the master's
`--default_kv_lease_ttl`: a leased object is neither evicted nor removable. An audit that visits
each key more often than the lease lasts pins everything it claims, so pace it slower than the
lease (run the master with a short lease, e.g. 1 s: a page read takes milliseconds). Removals
refused for a lease are retried on later drains; the claim is dropped at once (a claim may lag
the bytes, never lead them), and a confirmed write of the key before the retry cancels it.

Failures never raise into the caller: a master that is down at start is retried every
`reconnect_interval_s` (probed by TCP first: the client's own setup retries for ~90 s), and a
master that dies mid-batch turns the rest of the batch into False/None.
"""
from __future__ import annotations

import ctypes
import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from .base import BytesLike, StorageCapacity, check_batch
from .ledger import LruLedger

log = logging.getLogger(__name__)

# Mooncake's error codes (mooncake-store/include/types.h) the backend tells apart.
NO_SPACE = -200        # NO_AVAILABLE_HANDLE: the pool has no room for the object
INVALID_PARAMS = -600
NOT_FOUND = -704       # OBJECT_NOT_FOUND
HAS_LEASE = -706       # OBJECT_HAS_LEASE: being read; removal must wait for the lease to end
RPC_FAIL = -900        # the master is unreachable
_NAMES = {NO_SPACE: "no space", INVALID_PARAMS: "invalid params", NOT_FOUND: "not found",
          HAS_LEASE: "leased", RPC_FAIL: "master unreachable"}


def _addr(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte (the buffer stays owned by the caller)."""
    if not view.nbytes:
        return 0
    if view.readonly:  # bytes: numpy takes read-only buffers (ctypes does not)
        return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    return ctypes.addressof(ctypes.c_char.from_buffer(view))  # 10x cheaper than numpy's


def _bytes_view(v: BytesLike) -> memoryview:
    mv = v if isinstance(v, memoryview) else memoryview(v)
    if not mv.c_contiguous:
        raise ValueError("storage values must be contiguous buffers")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


_UNITS = {"": 1, "b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40}


def parse_size(v: int | str, what: str) -> int:
    """Bytes from an int or a string such as "4gb" / "512MB" (SGLang's config writes sizes so)."""
    if isinstance(v, bool):
        raise ValueError(f"{what} must be a size, got {v!r}")
    if isinstance(v, int):
        n = v
    elif isinstance(v, str):
        t = v.strip().lower().replace(" ", "")
        num = t.rstrip("kmgtb")
        unit = t[len(num):]
        if unit not in _UNITS or not num.isdigit():
            raise ValueError(f"{what}: cannot read size {v!r} (use bytes or e.g. '512mb', '4gb')")
        n = int(num) * _UNITS[unit]
    else:
        raise ValueError(f"{what} must be a size, got {type(v).__name__}")
    if n < 1:
        raise ValueError(f"{what} must be > 0, got {v!r}")
    return n


def _probe(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _host_port(addr: str, default_port: int) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host:
        return addr, default_port
    try:
        return host.strip("[]"), int(port)
    except ValueError as exc:
        raise ValueError(f"bad address {addr!r}: port is not a number") from exc


class MooncakeStorageBackend:
    __slots__ = (
        "name", "shared", "prefix", "_cfg", "_store", "_batch", "_ledger", "_evicted", "_doomed",
        "_lock", "_down", "_next_connect", "_reconnect_s", "_connect_timeout", "_audit_s", "_audit_batch",
        "_next_audit", "_audit_cursor", "failures", "refused_no_space", "audited_keys", "audit_losses",
        "read_losses", "connects",
    )

    def __init__(
        self,
        master_server_address: str = "127.0.0.1:50051",
        metadata_server: str = "http://127.0.0.1:8080/metadata",
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        global_segment_size: int | str = 256 << 20,
        local_buffer_size: int | str = 64 << 20,
        prefix: str = "kvatlas:",
        capacity_bytes: int | str | None = None,
        shared: bool = True,
        *,
        batch_size: int = 512,
        audit_interval_s: float = 1.0,
        audit_batch: int = 4096,
        reconnect_interval_s: float = 5.0,
        connect_timeout_s: float = 1.0,
        name: str | None = None,
    ) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore  # noqa: F401
        except ImportError as exc:
            raise ValueError(
                "the mooncake storage backend needs `pip install mooncake-transfer-engine-non-cuda` "
                f"(and the system libraries libibverbs1 librdmacm1 libnuma1): {exc}"
            ) from exc
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        global_segment_size = parse_size(global_segment_size, "global_segment_size")
        local_buffer_size = parse_size(local_buffer_size, "local_buffer_size")
        if capacity_bytes is not None:
            capacity_bytes = parse_size(capacity_bytes, "capacity_bytes")
        for what, v in (("batch_size", batch_size), ("audit_batch", audit_batch)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{what} must be a positive integer, got {v!r}")
        if audit_interval_s <= 0 or reconnect_interval_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("audit_interval_s, reconnect_interval_s and connect_timeout_s must be > 0")
        _host_port(master_server_address, 50051)  # validates the address up front
        if metadata_server.startswith("http") and not urlsplit(metadata_server).port:
            raise ValueError(f"metadata_server {metadata_server!r} needs an explicit port")
        self.name = name or f"mooncake:{master_server_address}"
        self.shared = bool(shared)
        self.prefix = prefix
        self._cfg: dict[str, Any] = dict(local_hostname=local_hostname, metadata_server=metadata_server,
                         global_segment_size=global_segment_size, local_buffer_size=local_buffer_size,
                         protocol=protocol, rdma_devices=device_name, master_server_addr=master_server_address)
        self._store: Any = None
        self._batch = batch_size
        self._ledger = LruLedger(capacity_bytes)  # what this backend claims, with sizes, LRU first
        self._evicted: list[str] = []
        self._doomed: list[str] = []  # removals the store refused for a read lease: retried
        self._lock = threading.Lock()
        self._down = False
        self._next_connect = 0.0
        self._reconnect_s = reconnect_interval_s
        self._connect_timeout = connect_timeout_s
        self._audit_s = audit_interval_s
        self._audit_batch = audit_batch
        self._next_audit = 0.0
        self._audit_cursor = 0
        self.failures = 0
        self.refused_no_space = 0
        self.audited_keys = 0
        self.audit_losses = 0
        self.read_losses = 0
        self.connects = 0

    # -- connection ----------------------------------------------------------------------------
    def _reachable(self) -> bool:
        host, port = _host_port(self._cfg["master_server_addr"], 50051)
        if not _probe(host, port, self._connect_timeout):
            return False
        meta = self._cfg["metadata_server"]
        if meta.startswith("http"):
            u = urlsplit(meta)
            return _probe(u.hostname or "127.0.0.1", u.port or 80, self._connect_timeout)
        return True

    def _client(self) -> Any:
        """The connected store, or None (then retried after `reconnect_interval_s`)."""
        if self._store is not None:
            return self._store
        now = time.monotonic()
        if now < self._next_connect:
            return None
        self._next_connect = now + self._reconnect_s
        if not self._reachable():
            self._failed("connect", "master or metadata server unreachable")
            return None
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        c = self._cfg
        rc = store.setup(c["local_hostname"], c["metadata_server"], c["global_segment_size"], c["local_buffer_size"],
                         c["protocol"], c["rdma_devices"], c["master_server_addr"])
        if rc != 0:
            self._failed("setup", f"returned {rc}")
            try:
                store.close()
            except Exception:  # noqa: BLE001 - a half-set-up client may fail to close; it is dropped
                pass
            return None
        self.connects += 1
        self._store = store
        self._ok()
        log.info("Mooncake L3 %s: connected (segment %d bytes)", self.name, c["global_segment_size"])
        return store

    def _failed(self, what: str, why: object) -> None:
        self.failures += 1
        if not self._down:
            self._down = True
            log.warning("Mooncake L3 %s: %s failed (%s); reporting misses until it recovers", self.name, what, why)

    def _ok(self) -> None:
        if self._down:
            self._down = False
            log.info("Mooncake L3 %s: reachable again", self.name)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _codes(self, codes: Sequence[int], what: str) -> None:
        if any(c == RPC_FAIL for c in codes):
            self._failed(what, _NAMES[RPC_FAIL])
        elif codes:
            self._ok()

    # -- StorageBackend ------------------------------------------------------------------------
    def set(self, keys: Sequence[str], values: Sequence[BytesLike]) -> list[bool]:
        check_batch(keys, values)
        views = [_bytes_view(v) for v in values]
        out = [False] * len(keys)
        with self._lock:
            store = self._client()
            if store is None:
                return out
            admit, charge = self._plan(keys, views)
            self._make_room(store, keys, charge)
            for lo in range(0, len(keys), self._batch):
                idx = [i for i in range(lo, min(lo + self._batch, len(keys))) if admit[i]]
                if not idx:
                    continue
                codes = store.batch_put_from([self._k(keys[i]) for i in idx], [_addr(views[i]) for i in idx],
                                             [views[i].nbytes for i in idx])
                self._codes(codes, "put")
                for i, rc in zip(idx, codes):
                    if rc == 0:
                        out[i] = True
                        self._ledger.put(keys[i], max(views[i].nbytes, self._ledger.sizes.get(keys[i], 0)))
                    elif rc == NO_SPACE:
                        self.refused_no_space += 1
                    else:
                        self.failures += 1
                if any(rc == RPC_FAIL for rc in codes):
                    break
            if self._doomed and any(out):  # written again: a pending removal would take the claim's bytes
                confirmed = {k for k, o in zip(keys, out) if o}
                self._doomed = [k for k in self._doomed if k not in confirmed]
        refused = len(keys) - sum(out)
        if refused:
            log.debug("Mooncake L3 %s: %d of %d puts not confirmed", self.name, refused, len(keys))
        return out

    def _plan(self, keys: Sequence[str], views: Sequence[memoryview]) -> tuple[list[bool], int]:
        """Which values of a batch are written, and the bytes they add to this backend's claims.

        Non-empty values are admitted in order while the share holds them, counting the claims
        the batch's own keys already hold (those stay, the rest of the share can be evicted); the
        first value that does not fit refuses the rest (a batch larger than the share writes its
        head). A key already claimed is charged max(old, new): Mooncake keeps the first object of
        a key (a put of a key it holds is a no-op that returns 0), and a refused rewrite keeps its
        old bytes."""
        limit = self._ledger.limit_bytes
        held = {k: self._ledger.sizes.get(k, 0) for k in keys}  # each batch key's claim, as written
        base = total = sum(held.values())
        out = []
        full = False
        for k, v in zip(keys, views):
            grow = max(0, v.nbytes - held[k])
            ok = v.nbytes > 0 and not full and (limit is None or total + grow <= limit)
            if ok:
                total += grow
                held[k] += grow
            elif v.nbytes > 0:
                full = True
            out.append(ok)
        return out, total - base

    def _make_room(self, store: Any, keys: Sequence[str], incoming: int) -> None:
        """Keep this backend within its share: drop its LRU keys outside the batch (reported as
        evicted) so `incoming` more bytes fit."""
        victims = self._ledger.victims(incoming, protect=keys)
        if not victims:
            return
        for k in victims:
            self._ledger.remove(k)
        self._evicted.extend(victims)
        self._remove(store, victims)

    def _remove(self, store: Any, keys: list[str]) -> int:
        """Remove keys from the store; leased ones (being read) are retried later."""
        n = 0
        for lo in range(0, len(keys), self._batch):
            chunk = keys[lo:lo + self._batch]
            codes = store.batch_remove([self._k(k) for k in chunk])
            self._codes(codes, "remove")
            for k, rc in zip(chunk, codes):
                if rc == 0:
                    n += 1
                elif rc == HAS_LEASE or rc == RPC_FAIL:
                    self._doomed.append(k)
                elif rc != NOT_FOUND:
                    self.failures += 1
                    log.warning("Mooncake L3 %s: remove of %r failed (%s)", self.name, k, _NAMES.get(rc, rc))
        return n

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values as bytes (one copy out of the client's buffer); `get_into` is the zero-copy read."""
        check_batch(keys)
        out: list[bytes | None] = [None] * len(keys)
        with self._lock:
            store = self._client()
            if store is None:
                return out
            for lo in range(0, len(keys), self._batch):
                chunk = keys[lo:lo + self._batch]
                handles = store.batch_get_buffer([self._k(k) for k in chunk])
                missed = []
                for j, (k, h) in enumerate(zip(chunk, handles)):
                    if h is None:
                        missed.append(k)
                    else:
                        out[lo + j] = ctypes.string_at(h.ptr(), h.size())
                claimed = [k for k in missed if k in self._ledger]
                if claimed:  # absent, or the master unreachable? only the first is a loss
                    codes = store.batch_is_exist([self._k(k) for k in claimed])
                    self._codes(codes, "get")
                    for k, c in zip(claimed, codes):
                        if c == 0:
                            self._read_miss(k)
        return out

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        """Read each value straight into its buffer (`batch_get_into`): bytes read, or -1 when the
        key is absent, the store unreachable or the value does not fit its buffer."""
        check_batch(keys)
        if len(buffers) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        views = [_bytes_view(b) for b in buffers]
        if any(v.readonly for v in views):
            raise ValueError("get_into needs writable buffers")
        out = [-1] * len(keys)
        with self._lock:
            store = self._client()
            if store is None:
                return out
            for lo in range(0, len(keys), self._batch):
                hi = min(lo + self._batch, len(keys))
                codes = store.batch_get_into([self._k(k) for k in keys[lo:hi]], [_addr(v) for v in views[lo:hi]],
                                             [v.nbytes for v in views[lo:hi]])
                self._codes(codes, "get")
                for i, rc in zip(range(lo, hi), codes):
                    if rc >= 0:
                        out[i] = rc
                    elif rc == NOT_FOUND:
                        self._read_miss(keys[i])
                if any(rc == RPC_FAIL for rc in codes):
                    break
        return out

    def _read_miss(self, key: str) -> None:
        if self._ledger.remove(key) is not None:  # claimed, but the store lost it: say so now
            self.read_losses += 1
            self._evicted.append(key)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        check_batch(keys)
        out = [False] * len(keys)
        with self._lock:
            store = self._client()
            if store is None:
                return out
            for lo in range(0, len(keys), self._batch):
                codes = store.batch_is_exist([self._k(k) for k in keys[lo:lo + self._batch]])
                self._codes(codes, "exist")
                out[lo:lo + len(codes)] = [c == 1 for c in codes]
        return out

    def delete(self, keys: Sequence[str]) -> int:
        check_batch(keys)
        with self._lock:
            for k in keys:
                self._ledger.remove(k)
            store = self._client()
            if store is None:
                self._doomed.extend(keys)
                return 0
            return self._remove(store, list(keys))

    def capacity(self) -> StorageCapacity:
        """This backend's share: the bytes it claims and `capacity_bytes` (None: unbounded)."""
        with self._lock:
            return StorageCapacity(self._ledger.used_bytes, self._ledger.limit_bytes)

    @property
    def pending_removals(self) -> int:
        """Removals the store refused for a lease (a read, or an existence check, holds one for
        `--default_kv_lease_ttl`); `drain_evicted` retries them."""
        with self._lock:
            return len(self._doomed)

    def knows(self, keys: list[str]) -> list[bool] | None:
        """None: other workers write to the same store, so its contents are not known here."""
        return None

    # -- what the store dropped on its own -----------------------------------------------------
    def drain_evicted(self) -> list[str]:
        """Claimed keys the store no longer holds: this backend's own capacity removals, reads that
        found a claimed key gone, and what the audit found missing."""
        with self._lock:
            if self._store is not None:
                if self._doomed:
                    doomed, self._doomed = self._doomed, []
                    self._remove(self._store, doomed)
                now = time.monotonic()
                if now >= self._next_audit:
                    self._next_audit = now + self._audit_s
                    self._audit(self._store)
            out, self._evicted = self._evicted, []
        return out

    def audit_now(self) -> list[str]:
        """One full audit of every claimed key (tests, shutdown checks); returns what it found lost."""
        with self._lock:
            store = self._client()
            if store is None:
                return []
            lost: list[str] = []
            keys = self._ledger.keys()
            for lo in range(0, len(keys), self._batch):
                lost += self._check(store, keys[lo:lo + self._batch])
            return lost

    def _audit(self, store: Any) -> None:
        keys = self._ledger.keys()
        if not keys:
            return
        if self._audit_cursor >= len(keys):
            self._audit_cursor = 0
        chunk = keys[self._audit_cursor:self._audit_cursor + self._audit_batch]
        self._audit_cursor += len(chunk)
        for lo in range(0, len(chunk), self._batch):
            self._check(store, chunk[lo:lo + self._batch])

    def _check(self, store: Any, keys: list[str]) -> list[str]:
        codes = store.batch_is_exist([self._k(k) for k in keys])
        self._codes(codes, "audit")
        self.audited_keys += len(keys)
        lost = [k for k, c in zip(keys, codes) if c == 0]
        for k in lost:
            self._ledger.remove(k)
        if lost:
            self.audit_losses += len(lost)
            self._evicted.extend(lost)
            log.info("Mooncake L3 %s: audit found %d claimed keys gone", self.name, len(lost))
        return lost

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
            if store is not None:
                try:
                    store.close()
                except Exception as exc:  # noqa: BLE001 - shutting down: log and go on
                    log.warning("Mooncake L3 %s: close failed: %s", self.name, exc)
