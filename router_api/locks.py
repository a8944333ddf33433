"""The service's lock when ingestion runs as several pipelines (`--ingest-shards N`, docs/service.md).

One `threading.Lock` per index shard: ingest pipeline i holds `shard(i)` for one batch / one run chunk
of its own workers (their index shard and their registry entries, nobody else's), so the pipelines
apply in parallel. Everything else — /score, registration, snapshots, the policy tick — takes the
whole `ShardedLock` (`with lock:`), which acquires every shard lock in index order and releases them in
reverse: it excludes every pipeline, as the single lock does, and the fixed order means two holders of
the whole lock cannot deadlock. Rule for holders of one shard lock: never wait for another lock of
this set while holding it (take the whole lock only with nothing held).
"""
from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Callable

__all__ = ["ShardedLock", "MAX_SHARDS"]

# More pipelines than this is a configuration error, not a machine size (one thread and socket set each).
MAX_SHARDS = 64


class ShardedLock:
    """N shard locks used as one exclusive lock (`with`, `acquire`, `release`, `locked`), or one
    shard at a time (`shard(i)`)."""

    __slots__ = ("_locks",)

    def __init__(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SHARDS:
            raise ValueError(f"a sharded lock needs 1..{MAX_SHARDS} shards, got {n!r}")
        self._locks = tuple(threading.Lock() for _ in range(n))

    def __len__(self) -> int:
        return len(self._locks)

    def shard(self, i: int) -> threading.Lock:
        """Shard i's lock (an ingest pipeline's per-batch hold)."""
        return self._locks[i]

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Every shard lock, in index order; `timeout` bounds the whole acquisition. On failure none is
        left held (threading.Lock semantics)."""
        if not blocking:
            if timeout != -1:
                raise ValueError("can't specify a timeout for a non-blocking call")
            return self._acquire_each(lambda lk: lk.acquire(False))
        if timeout < 0:
            for lk in self._locks:
                lk.acquire()
            return True
        deadline = time.monotonic() + timeout
        return self._acquire_each(lambda lk: lk.acquire(True, max(0.0, deadline - time.monotonic())))

    def _acquire_each(self, take: Callable[[threading.Lock], bool]) -> bool:
        held: list[threading.Lock] = []
        for lk in self._locks:
            if not take(lk):
                for h in reversed(held):
                    h.release()
                return False
            held.append(lk)
        return True

    def release(self) -> None:
        for lk in reversed(self._locks):
            lk.release()

    def locked(self) -> bool:
        """True while any shard lock is held (as `Lock.locked`: someone holds what `acquire` needs)."""
        return any(lk.locked() for lk in self._locks)

    def __enter__(self) -> bool:
        for lk in self._locks:
            lk.acquire()
        return True

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for lk in reversed(self._locks):
            lk.release()
