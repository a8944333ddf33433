"""Page allocator: hands out page indices of a fixed-size pool. Plain data structure, no torch."""
from __future__ import annotations

from collections.abc import Iterable


class PoolExhausted(RuntimeError):
    """Raised when an allocation asks for more pages than are free (after any eviction)."""


class PageAllocator:
    """Free list over pages [0, num_pages). Double frees and foreign pages are refused loudly,
    because either would let two owners share one page and silently corrupt KV bytes."""

    __slots__ = ("name", "num_pages", "_free", "_used")

    def __init__(self, num_pages: int, name: str = "pool") -> None:
        if num_pages <= 0:
            raise ValueError(f"{name}: num_pages must be positive, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        # Pop from the end: lowest pages are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self._used)

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} pages")
        if n > len(self._free):
            raise PoolExhausted(
                f"{self.name}: asked for {n} pages but only {len(self._free)} of "
                f"{self.num_pages} are free ({len(self._used)} in use)"
            )
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        self._used.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        bad = [p for p in pages if p not in self._used]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"{self.name}: freeing pages not in use (double free?): {bad[:8] or pages[:8]}")
        self._used.difference_update(pages)
        self._free.extend(pages)

    def reset(self) -> None:
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._used.clear()
