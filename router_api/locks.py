"""The service's lock when ingestion runs as several pipelines (`--ingest-shards N`, docs/service.md).

One `threading.Lock` per index shard: ingest pipeline i holds `shard(i)` for one batch / one run chunk
of its own workers (their index shard and their registry entries, nobody else's), so the pipelines
apply in parallel. Everything else — /score, registration, snapshots, the policy tick — takes the
whole `ShardedLock` (`with lock:`), which holds every shard lock at once: it excludes every pipeline,
as the single lock does. It never waits for one shard lock while holding another (`_acquire_all`), so
neither a deadlock nor a convoy behind one pipeline's chunk can form. Rule for holders of one shard
lock: never wait for another lock of this set while holding it (take the whole lock only with
nothing held).
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

    __slots__ = ("_locks", "_back")

    def __init__(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SHARDS:
            raise ValueError(f"a sharded lock needs 1..{MAX_SHARDS} shards, got {n!r}")
        self._locks = tuple(threading.Lock() for _ in range(n))
        self._back = self._locks[::-1]  # release order, without a reversed() iterator per exit

    def __len__(self) -> int:
        return len(self._locks)

    def shard(self, i: int) -> threading.Lock:
        """Shard i's lock (an ingest pipeline's per-batch hold)."""
        return self._locks[i]

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Every shard lock (with `timeout`: in index order, bounded; without: `_acquire_all`). On failure none is
        left held (threading.Lock semantics)."""
        if not blocking:
            if timeout != -1:
                raise ValueError("can't specify a timeout for a non-blocking call")
            return self._acquire_each(lambda lk: lk.acquire(False))
        if timeout < 0:
            self._acquire_all()
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
        for lk in self._back:
            lk.release()

    def locked(self) -> bool:
        """True while any shard lock is held (as `Lock.locked`: someone holds what `acquire` needs)."""
        return any(lk.locked() for lk in self._locks)

    def __enter__(self) -> bool:
        # Uncontended (every /score between runs): the first lock, then the others without waiting,
        # with no list built (a third of the old cost); at a busy one `_acquire_all` decides, holding nothing.
        locks = self._locks
        locks[0].acquire()
        for i in range(1, len(locks)):
            if not locks[i].acquire(False):
                for h in locks[:i]:
                    h.release()
                self._acquire_all(i)
                break
        return True

    def _acquire_all(self, first: int = 0) -> None:
        """Every shard lock, never holding one while waiting for another: wait for one, try the rest
        without waiting, and on a busy one let go of all and wait for that one instead. Taking them in
        order instead held shard 0 while waiting for shard 1's run chunk — every /score stalled the
        pipelines one after the other (a backlog drained 1.22M vs 1.56M blocks/s with this, medians
        of 8 interleaved runs on 2 cores; docs/history.md, "Session 6")."""
        locks = self._locks
        while True:
            locks[first].acquire()
            held = [first]
            for i in range(len(locks)):
                if i == first:
                    continue
                if not locks[i].acquire(False):
                    for j in held:
                        locks[j].release()
                    first = i
                    break
                held.append(i)
            else:
                return

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for lk in self._back:
            lk.release()
