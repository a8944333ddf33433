"""Page-granular copy engines between KV pools (device <-> host), with completion acks.

A pool is a tensor whose dim 0 is the page index. `submit` queues `dst[dst_pages] = src[src_pages]`
and returns an op id; `poll` reports `(op_id, tag)` only once the bytes are in `dst`. The cache's
emission rule ("a store is emitted only when the bytes are resident and the copy acknowledged")
rests on that guarantee, so no engine here ever acks before the copy has landed.

- `CudaTransferEngine`: one CUDA stream per direction, an event recorded after each copy,
  completion read from `event.query()`. Every CUDA call is guarded: constructing it without a GPU
  raises `TransferEngineUnavailable`, and this module imports on CPU-only machines.
- `ThreadTransferEngine`: a copy thread; an optional latency/bandwidth model delays the ack so the
  asynchrony is real in tests.
- `ManualTransferEngine`: nothing lands until the test calls `complete(op_ids)`.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

log = logging.getLogger(__name__)

Completion = tuple[int, object]
Failure = tuple[int, object, str]  # (op id, tag, reason)


class TransferEngineUnavailable(RuntimeError):
    """The requested engine cannot run here (e.g. CUDA engine without a GPU)."""


class TransferError(RuntimeError):
    """A copy failed after submission (reported by `poll_failed`, never acked as complete)."""


@runtime_checkable
class TransferEngine(Protocol):
    def submit(self, src: torch.Tensor, src_pages: Sequence[int], dst: torch.Tensor, dst_pages: Sequence[int],
               tag: object = None) -> int:
        """Queue `dst[dst_pages] = src[src_pages]`; the op id comes back from `poll` once it landed."""
        ...

    def poll(self) -> list[Completion]: ...

    def poll_failed(self) -> list[Failure]: ...

    def wait_all(self, timeout: float | None = None) -> list[Completion]: ...

    @property
    def inflight(self) -> int: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Pure helpers (no I/O): validation and run decomposition.


def _as_page_list(pages: Sequence[int] | torch.Tensor, what: str) -> list[int]:
    if isinstance(pages, torch.Tensor):
        if pages.dim() != 1 or pages.dtype.is_floating_point or pages.dtype == torch.bool:
            raise ValueError(f"{what} must be a 1-D integer sequence, got tensor {pages.dtype} {tuple(pages.shape)}")
        return [int(p) for p in pages.tolist()]
    out: list[int] = []
    for p in pages:
        if isinstance(p, (int, np.integer)) and not isinstance(p, (bool, np.bool_)):
            out.append(int(p))  # numpy ints are common from slot allocators
        else:
            raise ValueError(f"{what} must contain ints, got {type(p).__name__}")
    return out


def validate_copy(
    src: torch.Tensor, src_pages: Sequence[int], dst: torch.Tensor, dst_pages: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Check a page copy is well-formed; return the page lists. Raises ValueError with the reason."""
    if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
        raise ValueError("src and dst must be torch tensors")
    if src.dim() < 1 or dst.dim() < 1:
        raise ValueError("pools must have a page dimension (dim 0)")
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"page shape mismatch: src {tuple(src.shape[1:])} vs dst {tuple(dst.shape[1:])}")
    if src.dtype != dst.dtype:
        raise ValueError(f"dtype mismatch: src {src.dtype} vs dst {dst.dtype}")
    sp = _as_page_list(src_pages, "src_pages")
    dp = _as_page_list(dst_pages, "dst_pages")
    if len(sp) != len(dp):
        raise ValueError(f"src_pages has {len(sp)} pages but dst_pages has {len(dp)}")
    n_src, n_dst = src.shape[0], dst.shape[0]
    for p in sp:
        if not 0 <= p < n_src:
            raise ValueError(f"src page {p} out of range [0, {n_src})")
    for p in dp:
        if not 0 <= p < n_dst:
            raise ValueError(f"dst page {p} out of range [0, {n_dst})")
    if len(set(dp)) != len(dp):
        raise ValueError("dst_pages contains duplicates (the copy result would be ambiguous)")
    same_pool = src.data_ptr() == dst.data_ptr() and src.shape == dst.shape and src.stride() == dst.stride()
    if same_pool and set(sp) & set(dp):
        raise ValueError("src and dst pages overlap within the same pool")
    return sp, dp


def page_runs(pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive pages as (position in list, first page, length).

    Lets cross-device copies use a few large contiguous transfers instead of one per page.
    """
    runs: list[tuple[int, int, int]] = []
    i, n = 0, len(pages)
    while i < n:
        j = i + 1
        while j < n and pages[j] == pages[j - 1] + 1:
            j += 1
        runs.append((i, pages[i], j - i))
        i = j
    return runs


def page_bytes(t: torch.Tensor) -> int:
    """Bytes of one page of pool `t`."""
    per = t.element_size()
    for d in t.shape[1:]:
        per *= int(d)
    return per


def _copy_pages(src: torch.Tensor, sp: list[int], dst: torch.Tensor, dp: list[int]) -> None:
    """Synchronous page copy (CPU paths)."""
    if not sp:
        return
    s_idx = torch.tensor(sp, dtype=torch.long, device=src.device)
    d_idx = torch.tensor(dp, dtype=torch.long, device=dst.device)
    gathered = src.index_select(0, s_idx)
    if gathered.device != dst.device:
        gathered = gathered.to(dst.device)
    dst.index_copy_(0, d_idx, gathered)


class _Op:
    __slots__ = ("op_id", "tag", "src", "sp", "dst", "dp", "nbytes", "keep", "event")

    def __init__(self, op_id: int, tag: object, src: torch.Tensor, sp: list[int], dst: torch.Tensor, dp: list[int]):
        self.op_id = op_id
        self.tag = tag
        self.src = src
        self.sp = sp
        self.dst = dst
        self.dp = dp
        self.nbytes = page_bytes(src) * len(sp)
        self.keep: list[torch.Tensor] = []  # temporaries that must outlive the async copy
        self.event: Any = None  # a torch.cuda.Event once recorded


class _EngineBase:
    """The bookkeeping every engine shares: op ids, the submit-time checks, the acks and failures
    that `poll` / `poll_failed` hand over once each, the closed flag and `with engine:`.

    An engine says only how a copy lands: `_start(op)` (called under `_lock`, after the checks) and
    `_collect()` (called under `_lock` by `poll`, moving what has landed into `_done`). The thread
    engine passes its Condition as the lock, since its copy thread fills the same lists.
    """

    __slots__ = ("_ids", "_lock", "_done", "_failed", "_closed")

    def __init__(self, lock: threading.Lock | threading.Condition | None = None) -> None:
        self._ids = itertools.count()
        self._lock = lock if lock is not None else threading.Lock()
        self._done: list[Completion] = []
        self._failed: list[Failure] = []
        self._closed = False

    def submit(
        self,
        src: torch.Tensor,
        src_pages: Sequence[int],
        dst: torch.Tensor,
        dst_pages: Sequence[int],
        tag: object = None,
    ) -> int:
        sp, dp = validate_copy(src, src_pages, dst, dst_pages)
        with self._lock:
            if self._closed:
                raise RuntimeError("transfer engine is closed")
            op = _Op(next(self._ids), tag, src, sp, dst, dp)
            self._start(op)
        return op.op_id

    def _start(self, op: _Op) -> None:
        raise NotImplementedError

    def _collect(self) -> None:
        """Move copies that have landed into `_done` (engines whose acks arrive by themselves: no-op)."""

    def _ack(self, op: _Op) -> None:
        self._done.append((op.op_id, op.tag))

    def _fail(self, op: _Op, why: BaseException | str) -> None:
        """Report `op` through `poll_failed`; it is never acked."""
        if isinstance(why, BaseException):
            log.error("transfer op %d failed: %s", op.op_id, why)
            why = repr(why)
        self._failed.append((op.op_id, op.tag, why))

    def poll(self) -> list[Completion]:
        with self._lock:
            self._collect()
            done, self._done = self._done, []
        return done

    def poll_failed(self) -> list[Failure]:
        with self._lock:
            failed, self._failed = self._failed, []
        return failed

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# Manual engine: tests decide when (and in which order) copies land.


class ManualTransferEngine(_EngineBase):
    """Copies land only when `complete(op_ids)` is called — in any order.

    The data copy itself happens at completion, so an un-acked copy has really not landed.
    `wait_all` completes every pending op in submission order.
    """

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        super().__init__()
        self._pending: dict[int, _Op] = {}

    def _start(self, op: _Op) -> None:
        self._pending[op.op_id] = op

    def pending_ids(self) -> list[int]:
        return list(self._pending)

    def complete(self, op_ids: Sequence[int] | None = None) -> None:
        """Land the given ops (all pending when None). Unknown ids raise KeyError."""
        ids = list(self._pending) if op_ids is None else list(op_ids)
        unknown = [i for i in ids if i not in self._pending]
        if unknown:
            raise KeyError(f"no pending transfer op(s) {unknown}")
        for i in ids:
            op = self._pending.pop(i)
            try:
                _copy_pages(op.src, op.sp, op.dst, op.dp)
            except Exception as exc:  # report, never ack a copy that did not happen
                self._fail(op, exc)
                continue
            self._ack(op)

    def fail(self, op_ids: Sequence[int], reason: str = "injected failure") -> None:
        """Drop ops without copying, reporting them via `poll_failed` (fault injection)."""
        for i in op_ids:
            self._fail(self._pending.pop(i), reason)

    @property
    def inflight(self) -> int:
        return len(self._pending)

    def wait_all(self, timeout: float | None = None) -> list[Completion]:
        self.complete(None)
        return self.poll()

    def close(self) -> None:
        self._closed = True


# ---------------------------------------------------------------------------------------------
# Thread engine: CPU copies on a worker thread, optional link model.


class ThreadTransferEngine(_EngineBase):
    """Copies run on one thread, FIFO; each op is acked after its copy and after the simulated link
    (`latency_s` + bytes / `bandwidth_bytes_per_s`, serialised like one DMA engine) has elapsed.
    """

    __slots__ = ("_latency", "_bw", "_clock", "_cv", "_queue", "_landing", "_inflight", "_link_free_at", "_thread")

    def __init__(
        self,
        latency_s: float = 0.0,
        bandwidth_bytes_per_s: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        name: str = "kvatlas-transfer",
    ) -> None:
        if latency_s < 0:
            raise ValueError("latency_s must be >= 0")
        if bandwidth_bytes_per_s is not None and bandwidth_bytes_per_s <= 0:
            raise ValueError("bandwidth_bytes_per_s must be > 0 (or None for unlimited)")
        self._cv = threading.Condition()
        super().__init__(self._cv)  # the copy thread fills _done / _failed under the same lock
        self._latency = float(latency_s)
        self._bw = bandwidth_bytes_per_s
        self._clock = clock
        self._queue: deque[_Op] = deque()
        self._landing: list[tuple[float, int, _Op]] = []  # heap of (ack_time, op_id, op)
        self._inflight = 0
        self._link_free_at = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _start(self, op: _Op) -> None:
        self._queue.append(op)
        self._inflight += 1
        self._cv.notify_all()

    def _ack_time(self, op: _Op, copied_at: float) -> float:
        if self._bw is None and self._latency == 0.0:
            return copied_at
        wire = op.nbytes / self._bw if self._bw else 0.0
        self._link_free_at = max(self._link_free_at, copied_at) + wire
        return self._link_free_at + self._latency

    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    now = self._clock()
                    while self._landing and self._landing[0][0] <= now:
                        self._ack(heapq.heappop(self._landing)[2])
                        self._inflight -= 1
                        self._cv.notify_all()
                    if self._queue:
                        op = self._queue.popleft()
                        break
                    if self._closed and not self._landing:
                        self._cv.notify_all()
                        return
                    # Sleeping here models the link; acks are still what callers synchronise on.
                    self._cv.wait(self._landing[0][0] - now if self._landing else None)
            try:
                _copy_pages(op.src, op.sp, op.dst, op.dp)
            except Exception as exc:  # a bad copy must not kill the thread or be acked
                with self._cv:
                    self._fail(op, exc)
                    self._inflight -= 1
                    self._cv.notify_all()
                continue
            with self._cv:
                heapq.heappush(self._landing, (self._ack_time(op, self._clock()), op.op_id, op))

    @property
    def inflight(self) -> int:
        with self._cv:
            return self._inflight

    def wait_all(self, timeout: float | None = None) -> list[Completion]:
        """Block until every submitted op is acked (or failed). Raises TimeoutError on timeout."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._inflight == 0, timeout):
                raise TimeoutError(f"{self._inflight} transfer op(s) still in flight after {timeout}s")
        return self.poll()

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued copies (so no submitted data is lost), then stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("transfer thread did not stop within %.1fs", timeout)


# ---------------------------------------------------------------------------------------------
# CUDA engine: streams + events. Untested on CPU-only machines except for its refusal path.


def cuda_available() -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # broken driver installs raise instead of returning False
        return False


class CudaTransferEngine(_EngineBase):
    """Async copies on a dedicated CUDA stream per direction (H2D, D2H, D2D, H2H-via-CUDA).

    Each submit makes its stream wait for the caller's current stream (so KV written by compute is
    complete before it is read), issues the copy, records an event; `poll` reports ops whose event
    has completed. Host pools should be pinned for the copies to be truly asynchronous.
    """

    __slots__ = ("_device", "_streams", "_pending")

    def __init__(self, device: int | str | torch.device | None = None) -> None:
        if not cuda_available():
            raise TransferEngineUnavailable(
                "CudaTransferEngine needs a CUDA device (torch.cuda.is_available() is False); "
                "use ThreadTransferEngine or make_transfer_engine('auto')"
            )
        try:
            self._device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
            if self._device.type != "cuda":
                raise TransferEngineUnavailable(f"CudaTransferEngine needs a cuda device, got {self._device}")
        except TransferEngineUnavailable:
            raise
        except Exception as exc:
            raise TransferEngineUnavailable(f"cannot initialise CUDA: {exc}") from exc
        super().__init__()
        self._streams: dict[str, torch.cuda.Stream] = {}
        # per direction, ops in submission order: a stream completes in order, so poll stops at the
        # first unfinished op of each stream.
        self._pending: dict[str, deque[_Op]] = {}

    def _direction(self, src: torch.Tensor, dst: torch.Tensor) -> str:
        s = "d" if src.is_cuda else "h"
        d = "d" if dst.is_cuda else "h"
        return f"{s}2{d}"

    def _stream(self, direction: str) -> torch.cuda.Stream:
        st = self._streams.get(direction)
        if st is None:
            st = torch.cuda.Stream(device=self._device)
            self._streams[direction] = st
            self._pending[direction] = deque()
        return st

    def _start(self, op: _Op) -> None:
        if not (op.src.is_cuda or op.dst.is_cuda):
            raise ValueError("CudaTransferEngine copies need at least one CUDA pool")
        direction = self._direction(op.src, op.dst)
        stream = self._stream(direction)
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            if op.sp:
                self._issue(op, direction)
            ev = torch.cuda.Event()
            ev.record(stream)
        op.event = ev
        self._pending[direction].append(op)

    def _issue(self, op: _Op, direction: str) -> None:
        src, dst, sp, dp = op.src, op.dst, op.sp, op.dp
        if direction == "d2d":
            s_idx = torch.tensor(sp, dtype=torch.long).to(src.device, non_blocking=True)
            d_idx = torch.tensor(dp, dtype=torch.long).to(dst.device, non_blocking=True)
            dst.index_copy_(0, d_idx, src.index_select(0, s_idx))
            op.keep += [s_idx, d_idx]
        elif direction == "h2d":
            # contiguous host runs (pinned views stay pinned) into a device staging buffer, then scatter
            staging = torch.empty((len(sp),) + tuple(src.shape[1:]), dtype=src.dtype, device=dst.device)
            for pos, first, n in page_runs(sp):
                staging[pos : pos + n].copy_(src[first : first + n], non_blocking=True)
            d_idx = torch.tensor(dp, dtype=torch.long).to(dst.device, non_blocking=True)
            dst.index_copy_(0, d_idx, staging)
            op.keep += [staging, d_idx]
        else:  # d2h: gather on device, then contiguous runs into the host pool
            s_idx = torch.tensor(sp, dtype=torch.long).to(src.device, non_blocking=True)
            staging = src.index_select(0, s_idx)
            for pos, first, n in page_runs(dp):
                dst[first : first + n].copy_(staging[pos : pos + n], non_blocking=True)
            op.keep += [s_idx, staging]

    def _collect(self) -> None:
        for q in self._pending.values():
            while q:
                op = q[0]
                try:
                    finished = op.event.query()
                except Exception as exc:  # a CUDA error must not be mistaken for completion
                    q.popleft()
                    self._fail(op, exc)
                    continue
                if not finished:
                    break
                q.popleft()
                self._ack(op)

    @property
    def inflight(self) -> int:
        return sum(len(q) for q in self._pending.values())

    def wait_all(self, timeout: float | None = None) -> list[Completion]:
        deadline = None if timeout is None else time.monotonic() + timeout
        done: list[Completion] = []
        for q in self._pending.values():
            if not q:
                continue
            last = q[-1].event
            if deadline is None:
                last.synchronize()
            else:
                while not last.query():
                    if time.monotonic() > deadline:
                        done += self.poll()
                        raise TimeoutError(f"{self.inflight} CUDA transfer op(s) still in flight")
                    time.sleep(0.0005)  # busy-wait on hardware, not test synchronisation
        done += self.poll()
        return done

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.wait_all(timeout=30.0)
            except Exception as exc:
                log.warning("CUDA transfer engine closed with copies in flight: %s", exc)


def make_transfer_engine(kind: str = "auto", **kw: object) -> TransferEngine:
    """`auto` picks CUDA when a GPU is present, else the thread engine.

    Keyword arguments are passed to the chosen engine (for `auto`, link-model arguments are
    ignored by the CUDA engine and `device` by the thread engine).
    """
    k = kind.strip().lower()
    if k == "auto":
        if cuda_available():
            return CudaTransferEngine(device=kw.get("device"))  # type: ignore[arg-type]
        kw = {key: v for key, v in kw.items() if key != "device"}
        return ThreadTransferEngine(**kw)  # type: ignore[arg-type]
    if k == "cuda":
        return CudaTransferEngine(**kw)  # type: ignore[arg-type]
    if k == "thread":
        return ThreadTransferEngine(**kw)  # type: ignore[arg-type]
    if k == "manual":
        if kw:
            raise ValueError(f"manual transfer engine takes no options, got {sorted(kw)}")
        return ManualTransferEngine()
    raise ValueError(f"unknown transfer engine kind {kind!r}; expected auto, cuda, thread or manual")
