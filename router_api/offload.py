"""Large `/score` and `/query` bodies are answered off the event loop (`AnswerPool`; docs/service.md,
"HTTP stack"; docs/limits.md).

A 480k-token JSON body is ~3.2 MB: decoding it, hashing its blocks and walking the index takes
milliseconds, and on the event loop every other request — `/health` included — waits behind it. A
body of at least `min_bytes` is answered on one of a few worker threads instead; the long C sections
of that answer (the body parse, the block hashing) run without the GIL, so the loop keeps serving.
At most `max_pending` such answers are queued or running at once: one more is refused with 503
(reason `offload_full`) at once rather than queued without bound. Small bodies stay on the loop,
where a thread hand-off would cost more than the answer itself — except text requests (`prompt` /
`messages`), which always come here and are tokenized `TEXT_AT_ONCE` at a time.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

# Bodies of at least this many bytes are answered off the loop (~36k JSON tokens, ~1 ms of parse + walk).
OFFLOAD_MIN_BYTES = 256 * 1024
# Worker threads: the index lock serialises the walks, so more threads only overlap body parsing.
OFFLOAD_THREADS = 2
# Queued + running off-loop answers at most; one more answers 503 (a client's burst cannot pile up memory).
OFFLOAD_MAX_PENDING = 8
# Text /score requests tokenized at once (on this pool): tokenizers and chat templates hold the GIL for
# long stretches, so more in parallel would only starve the event loop; one more answers 503.
TEXT_AT_ONCE = 1


class AnswerPool:
    """A small bounded executor for large bodies' answers. `min_bytes` 0 turns it off (every body is
    answered on the loop: `kvatlas indexer --http-offload-bytes 0`, for comparison). Threads start on
    the first large body."""

    __slots__ = ("min_bytes", "threads", "max_pending", "_slots", "_executor", "_lock", "pending", "on_pending",
                 "text_slots")

    def __init__(self, min_bytes: int = OFFLOAD_MIN_BYTES, threads: int = OFFLOAD_THREADS,
                 max_pending: int = OFFLOAD_MAX_PENDING) -> None:
        if min_bytes < 0 or threads < 1 or max_pending < threads:
            raise ValueError("min_bytes must be >= 0, threads >= 1 and max_pending >= threads")
        self.min_bytes = min_bytes
        self.threads = threads
        self.max_pending = max_pending
        self._slots = threading.BoundedSemaphore(max_pending)
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.pending = 0  # queued + running
        self.on_pending: Callable[[int], None] | None = None  # told each new `pending` (the /metrics gauge)
        self.text_slots = threading.BoundedSemaphore(TEXT_AT_ONCE)  # text requests tokenizing now (score_text)

    def wants(self, size: int) -> bool:
        """True when a body of `size` bytes is answered off the loop."""
        return 0 < self.min_bytes <= size

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future | None:
        """`fn(*args)` on a worker thread; None when `max_pending` answers are already queued or running."""
        if not self._slots.acquire(blocking=False):
            return None
        with self._lock:
            self.pending += 1
            if self.on_pending is not None:
                self.on_pending(self.pending)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="kvatlas-answer")
        try:
            fut = self._executor.submit(fn, *args)
        except BaseException:
            self._done(None)
            raise
        fut.add_done_callback(self._done)
        return fut

    def _done(self, _fut: Future | None) -> None:
        with self._lock:
            self.pending -= 1
            if self.on_pending is not None:
                self.on_pending(self.pending)
        self._slots.release()

    def close(self) -> None:
        with self._lock:
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=False)
