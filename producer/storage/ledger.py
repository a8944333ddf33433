"""Byte-capacity LRU bookkeeping for a store — pure data, no I/O, no clock."""
from __future__ import annotations

from collections import OrderedDict
import threading
from collections.abc import Callable, Iterable, Sequence

from .base import StorageCapacity, copy_into


class LruLedger:
    """Tracks key sizes in LRU order and decides what to evict to honour a byte limit.

    The owning backend performs the actual deletions; the ledger only keeps the accounts.
    """

    __slots__ = ("limit_bytes", "used_bytes", "_sizes")

    def __init__(self, limit_bytes: int | None = None) -> None:
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError("capacity must be >= 0 bytes (or None for unlimited)")
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()

    @property
    def sizes(self) -> dict[str, int]:
        """Each key's size (read-only use)."""
        return self._sizes

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[str]:
        """Oldest first."""
        return list(self._sizes)

    def fits(self, size: int) -> bool:
        return self.limit_bytes is None or size <= self.limit_bytes

    def touch(self, key: str) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def put(self, key: str, size: int) -> None:
        old = self._sizes.pop(key, None)
        if old is not None:
            self.used_bytes -= old
        self._sizes[key] = size
        self.used_bytes += size

    def remove(self, key: str) -> int | None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size
        return size

    def victims(self, incoming: int, protect: Iterable[str] = ()) -> list[str]:
        """Least-recently-used keys to drop so `incoming` more bytes fit (not removed yet).

        Keys in `protect` (e.g. the rest of the batch being written) are skipped.
        """
        if self.limit_bytes is None:
            return []
        need = self.used_bytes + incoming - self.limit_bytes
        if need <= 0:
            return []
        guard = set(protect)
        out: list[str] = []
        for key, size in self._sizes.items():
            if key in guard:
                continue
            out.append(key)
            need -= size
            if need <= 0:
                break
        return out


class LedgerAccounting:
    """capacity / drain_evicted / close for backends that keep their bytes in an `LruLedger`
    (`_ledger`), log what they drop on their own in `_evicted`, and guard both with `_lock`."""

    __slots__ = ()
    # what the backend using this mixin provides
    _lock: threading.Lock | threading.RLock
    _ledger: LruLedger
    _evicted: list[str]
    get: Callable[[Sequence[str]], list[bytes | None]]

    def capacity(self) -> StorageCapacity:
        with self._lock:
            return StorageCapacity(self._ledger.used_bytes, self._ledger.limit_bytes)

    def knows(self, keys: list[str]) -> list[bool]:
        """Whether each key is in this backend's own index (no I/O; safe from any thread). For a
        node-local store this is what it holds; the cache uses it to size prefetches."""
        with self._lock:
            return [k in self._ledger for k in keys]

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        if len(buffers) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        return copy_into(self.get(keys), buffers)

    def drain_evicted(self) -> list[str]:
        with self._lock:
            out = self._evicted[:]
            self._evicted.clear()
        return out

    def close(self) -> None:
        pass
