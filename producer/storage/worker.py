"""Runs L3 backend operations on a thread so the scheduler never waits on storage.

The scheduler submits batches and polls results without blocking; backend exceptions are caught
and turned into failed results, so a misbehaving store can never kill the worker.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Sequence

from .base import BytesLike, StorageBackend, check_batch

log = logging.getLogger(__name__)

_STOP = object()


class StorageResult:
    """Outcome of one submitted batch.

    `ok[i]`: set -> key i confirmed written; get -> value i found (in `values`); get_into -> value i
    read into its buffer (`sizes[i]` bytes; -1 when not); exists -> key i
    present; delete -> the backend ran the request without raising (backends report deletes only
    as a count, so a key may survive an outage — a stale L3 copy, never a false store).
    """

    __slots__ = ("tag", "op", "keys", "ok", "values", "error", "sizes")

    def __init__(
        self,
        tag: object,
        op: str,
        keys: list[str],
        ok: list[bool],
        values: list[bytes | None] | None = None,
        error: str | None = None,
        sizes: list[int] | None = None,
    ) -> None:
        self.tag = tag
        self.op = op
        self.keys = keys
        self.ok = ok
        self.values = values
        self.error = error
        self.sizes = sizes

    def __repr__(self) -> str:
        return (
            f"StorageResult(op={self.op!r}, tag={self.tag!r}, keys={len(self.keys)}, "
            f"ok={sum(self.ok)}/{len(self.ok)}, error={self.error!r})"
        )


class _Request:
    __slots__ = ("op", "keys", "values", "tag")

    # values: the data of a set, the destination buffers of a get_into
    def __init__(self, op: str, keys: list[str], values: list[BytesLike] | None, tag: object) -> None:
        self.op = op
        self.keys = keys
        self.values = values
        self.tag = tag


class StorageWorker:
    """One thread executing backend batches in submission order.

    `submit_*` never block: they return False (and count a rejection) when `max_inflight` batches
    are already queued, so the caller can retry on a later step. `poll()` returns finished results.
    """

    __slots__ = (
        "backend", "max_inflight", "_idle_poll", "_q", "_lock", "_results", "_evicted", "_inflight",
        "_closed", "_idle", "rejected", "errors", "_thread",
    )

    def __enter__(self) -> StorageWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __init__(
        self,
        backend: StorageBackend,
        max_inflight: int = 64,
        *,
        idle_evict_poll_s: float | None = 1.0,
        name: str = "kvatlas-storage",
    ) -> None:
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        self.backend = backend
        self.max_inflight = max_inflight
        self._idle_poll = idle_evict_poll_s
        self._q: queue.Queue[object] = queue.Queue()
        self._lock = threading.Lock()
        self._results: deque[StorageResult] = deque()
        self._evicted: list[str] = []
        self._inflight = 0
        self._closed = False
        self._idle = threading.Condition(self._lock)
        self.rejected = 0
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- submission (scheduler thread) -------------------------------------------------------
    def _submit(self, op: str, keys: Sequence[str], values: Sequence[BytesLike] | None, tag: object,
                buffers: list[memoryview] | None = None) -> bool:
        check_batch(keys, values)
        with self._lock:
            if self._closed:
                raise RuntimeError("storage worker is closed")
            if self._inflight >= self.max_inflight:
                self.rejected += 1
                log.debug("storage worker full (%d in flight); %s batch deferred", self._inflight, op)
                return False
            self._inflight += 1
        payload: list[BytesLike] | None = (list(values) if values is not None
                                           else None if buffers is None else [b for b in buffers])
        self._q.put(_Request(op, list(keys), payload, tag))
        return True

    def submit_set(self, keys: Sequence[str], values: Sequence[BytesLike], tag: object = None) -> bool:
        return self._submit("set", keys, values, tag)

    def submit_get(self, keys: Sequence[str], tag: object = None) -> bool:
        return self._submit("get", keys, None, tag)

    def submit_get_into(self, keys: Sequence[str], buffers: Sequence[memoryview], tag: object = None) -> bool:
        """Read values straight into `buffers` (writable; the caller keeps them alive and unused
        until this batch's result is polled)."""
        if len(buffers) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        if any(not isinstance(b, memoryview) or b.readonly for b in buffers):
            raise ValueError("get_into buffers must be writable memoryviews")
        return self._submit("get_into", keys, None, tag, list(buffers))

    def submit_exists(self, keys: Sequence[str], tag: object = None) -> bool:
        return self._submit("exists", keys, None, tag)

    def submit_delete(self, keys: Sequence[str], tag: object = None) -> bool:
        return self._submit("delete", keys, None, tag)

    @property
    def inflight(self) -> int:
        with self._lock:
            return self._inflight

    def poll(self) -> list[StorageResult]:
        with self._lock:
            out = list(self._results)
            self._results.clear()
        return out

    def drain_evicted(self) -> list[str]:
        """Keys the backend dropped on its own, gathered on the worker thread.

        Call this *before* `poll()` in a step: every key returned here then has its set result
        already available from `poll()` (this step or an earlier one)."""
        with self._lock:
            out, self._evicted = self._evicted, []
        return out

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every submitted batch has a result (tests, shutdown). True if idle."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    # -- worker thread -----------------------------------------------------------------------
    def _execute(self, req: _Request) -> StorageResult:
        b = self.backend
        n = len(req.keys)
        try:
            if req.op == "set":
                assert req.values is not None
                ok = _bools(b.set(req.keys, req.values), n)
                return StorageResult(req.tag, "set", req.keys, ok)
            if req.op == "get":
                vals = b.get(req.keys)
                if len(vals) != n:
                    raise RuntimeError(f"backend returned {len(vals)} values for {n} keys")
                vals = [v if isinstance(v, bytes) else (bytes(v) if v is not None else None) for v in vals]
                return StorageResult(req.tag, "get", req.keys, [v is not None for v in vals], vals)
            if req.op == "get_into":
                sizes = [int(x) for x in b.get_into(req.keys, req.values)]  # type: ignore[arg-type]
                if len(sizes) != n:
                    raise RuntimeError(f"backend returned {len(sizes)} sizes for {n} keys")
                return StorageResult(req.tag, "get_into", req.keys, [x >= 0 for x in sizes], sizes=sizes)
            if req.op == "exists":
                return StorageResult(req.tag, "exists", req.keys, _bools(b.exists(req.keys), n))
            b.delete(req.keys)
            return StorageResult(req.tag, "delete", req.keys, [True] * n)
        except Exception as exc:  # never let a backend bug kill the worker
            self.errors += 1
            log.exception("storage backend %s failed on %s of %d keys", getattr(b, "name", b), req.op, n)
            return StorageResult(
                req.tag, req.op, req.keys, [False] * n, [None] * n if req.op == "get" else None, repr(exc),
                [-1] * n if req.op == "get_into" else None,
            )

    def _backend_evicted(self) -> list[str]:
        try:
            return list(self.backend.drain_evicted())
        except Exception:
            log.exception("storage backend drain_evicted failed")
            return []

    def _run(self) -> None:
        while True:
            try:
                item = self._q.get(timeout=self._idle_poll)
            except queue.Empty:
                evicted = self._backend_evicted()  # TTL/expiry notices arrive without any op
                if evicted:
                    with self._lock:
                        self._evicted.extend(evicted)
                continue
            if item is _STOP:
                evicted = self._backend_evicted()
                with self._lock:
                    self._evicted.extend(evicted)
                return
            assert isinstance(item, _Request)
            result = self._execute(item)
            evicted = self._backend_evicted()
            # Published together: a caller that drains evictions and then polls results always
            # sees the set result of any key it is told was evicted (a batch may evict its own
            # earlier keys), so it never applies an eviction before the store it undoes.
            with self._lock:
                self._results.append(result)
                self._evicted.extend(evicted)
                self._inflight -= 1
                self._idle.notify_all()

    def close(self, timeout: float = 10.0) -> None:
        """Finish batches already submitted (a confirmed backup is still reported), then stop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._q.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("storage worker did not stop within %.1fs", timeout)


def _bools(res: object, n: int) -> list[bool]:
    if not isinstance(res, list) or len(res) != n:
        raise RuntimeError(f"backend returned {res!r} for {n} keys")
    return [r is True for r in res]
