"""Sliding-window KV: per-page KV of the window layers, in its own pool.

A match ending at page boundary L (pages) needs the last `cdiv(W - 1, page_size)` pages before L —
vLLM's rule for sliding-window groups (docs/hybrid.md). Pages outside every live window may be
tombstoned (SWA pages freed, full KV kept)."""
from __future__ import annotations

from collections.abc import Sequence

from producer.components.base import SLIDING_WINDOW, Component, SlotPool
from schemas.rules import window_blocks


def window_pages(window: int, page_size: int) -> int:
    """Pages a sliding window of `window` tokens needs before a boundary (`schemas.rules.window_blocks`)."""
    return window_blocks(window, page_size)


class SlidingWindowComponent(Component):
    per_page = True
    kind = SLIDING_WINDOW
    __slots__ = ("need",)

    def __init__(self, name: str, group_idx: int, device: SlotPool, host: SlotPool | None = None,
                 *, window: int, page_size: int, suffix: str | None = None) -> None:
        if window <= 0:
            raise ValueError(f"{name}: sliding window must be positive, got {window}")
        super().__init__(name, group_idx, device, host, suffix=suffix, window=window)
        self.need = window_pages(window, page_size)

    def valid_end(self, ends: Sequence[bool], page_ok: Sequence[bool], end: int) -> bool:
        return all(page_ok[max(0, end - self.need):end])
