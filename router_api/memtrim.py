"""Give memory freed after an ingestion burst back to the OS.

A burst of KV events is buffered on its way in (ZeroMQ's receive queue, payload bytes, decoded
batches); once applied, that memory is free but glibc keeps it mapped, so the process's RSS stays
at the burst's peak — several times what the index itself holds (measured by bench_service.py:
~4x the index's bytes per block). `malloc_trim(0)` returns it. The ingest loop calls `maybe_trim`
whenever a poll finds the queues drained (fewer messages than one poll may take): at the end of a
burst, not only once it goes quiet, so what a burst leaves behind is returned as soon as it has been
applied. The policy is here, the clock is the caller's.
Without glibc (musl, macOS) this is a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Callable

log = logging.getLogger("kvatlas.memtrim")


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


class MemoryTrimmer:
    """Trims only after `min_batches` applied since the last trim, and at most once per
    `min_interval_s` unless `burst_batches` were applied since (a trim costs ~1 ms per 100 MB of
    heap; one per 5,000 batches, ~25 ms of apply, is ~1-2% of it at this service's heap sizes, and
    bounds what a burst leaves behind to 5,000 batches' garbage)."""

    __slots__ = ("_trim", "min_batches", "min_interval_s", "burst_batches", "_since", "_last", "trims")

    def __init__(self, min_batches: int = 2000, min_interval_s: float = 2.0,
                 trim: Callable[[int], int] | None | bool = True, burst_batches: int = 5_000) -> None:
        """`trim`: True loads glibc's malloc_trim; False/None disables trimming; a callable is used as is."""
        self._trim = _load_malloc_trim() if trim is True else (trim or None)
        self.min_batches = min_batches
        self.min_interval_s = min_interval_s
        self.burst_batches = max(burst_batches, min_batches)
        self._since = 0
        self._last: float | None = None
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def note(self, batches: int) -> None:
        self._since += batches

    def due(self, now: float) -> bool:
        return (self._trim is not None and self._since >= self.min_batches
                and (self._last is None or now - self._last >= self.min_interval_s
                     or self._since >= self.burst_batches))

    def maybe_trim(self, now: float) -> bool:
        """Trim if due (call when the queues are drained: nothing more was waiting). True if it trimmed."""
        if not self.due(now):
            return False
        assert self._trim is not None
        self._since = 0
        self._last = now
        try:
            self._trim(0)
        except Exception as exc:  # ctypes failure: stop trying, never disturb ingestion
            log.warning("event=malloc_trim_failed error=%r (disabled)", exc)
            self._trim = None
            return False
        self.trims += 1
        return True
