"""In-process L3 store (tests, single-process demos): same semantics as the file backend, no I/O."""
from __future__ import annotations

import threading
from collections.abc import Sequence

from .base import BytesLike, check_batch
from .ledger import LedgerAccounting, LruLedger


class MemoryStorageBackend(LedgerAccounting):
    __slots__ = ("name", "shared", "_data", "_ledger", "_evicted", "_lock")

    def __init__(self, capacity_bytes: int | None = None, shared: bool = False, *, name: str = "memory") -> None:
        self.name = name
        self.shared = bool(shared)
        self._data: dict[str, bytes] = {}
        self._ledger = LruLedger(capacity_bytes)
        self._evicted: list[str] = []
        self._lock = threading.Lock()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        check_batch(keys)
        with self._lock:
            return [k in self._data for k in keys]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        check_batch(keys)
        with self._lock:
            out = [self._data.get(k) for k in keys]
            for k, v in zip(keys, out):
                if v is not None:
                    self._ledger.touch(k)
            return out

    def set(self, keys: Sequence[str], values: Sequence[BytesLike]) -> list[bool]:
        check_batch(keys, values)
        out: list[bool] = []
        with self._lock:
            for k, v in zip(keys, values):
                b = bytes(v)
                if not self._ledger.fits(len(b)):
                    out.append(False)
                    continue
                self._ledger.remove(k)
                for victim in self._ledger.victims(len(b)):
                    self._ledger.remove(victim)
                    del self._data[victim]
                    self._evicted.append(victim)
                self._data[k] = b
                self._ledger.put(k, len(b))
                out.append(True)
        return out

    def delete(self, keys: Sequence[str]) -> int:
        check_batch(keys)
        with self._lock:
            n = 0
            for k in keys:
                if self._data.pop(k, None) is not None:
                    self._ledger.remove(k)
                    n += 1
            return n

