"""A dependency-free progress line: redrawn in place on a terminal, a line per 10% otherwise."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    __slots__ = ("total", "label", "stream", "tty", "done", "_last_pct", "_t0", "suffix")

    def __init__(self, total: int, label: str = "", stream: TextIO | None = None, suffix: str = "") -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0
        self._last_pct = -10
        self._t0 = time.monotonic()
        self.suffix = suffix

    def update(self, done: int) -> None:
        self.done = min(done, self.total)
        pct = 100 * self.done // self.total
        if self.tty:
            width = 30
            fill = width * self.done // self.total
            bar = "#" * fill + "." * (width - fill)
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} "
                              f"{time.monotonic() - self._t0:5.1f}s {self.suffix}")
            self.stream.flush()
        elif pct >= self._last_pct + 10:
            self._last_pct = pct - pct % 10
            self.stream.write(f"{self.label} {self.done}/{self.total} ({pct}%)\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
