"""Log lines of the HTTP service: rate-limited per key, and request values escaped to one line."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

log = logging.getLogger("kvatlas.http")


class RateLimitedLog:
    """At most one line per `interval_s` per key; the lines suppressed meanwhile are counted in
    the next one. Owned by one app (no global state); the clock is injectable for tests."""

    __slots__ = ("interval_s", "clock", "_next", "_suppressed")

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: Any) -> bool:
        return self._log(logging.WARNING, key, msg, args, None)

    def error(self, key: str, msg: str, *args: Any, exc_info: BaseException | None = None) -> bool:
        return self._log(logging.ERROR, key, msg, args, exc_info)

    def _log(self, level: int, key: str, msg: str, args: tuple[Any, ...], exc_info: BaseException | None) -> bool:
        now = self.clock()
        if now < self._next.get(key, 0.0):
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        if len(self._next) > 4096:  # keys come from request paths: keep the table bounded
            self._next = {k: t for k, t in self._next.items() if t > now}
            self._suppressed = {k: n for k, n in self._suppressed.items() if k in self._next}
        self._next[key] = now + self.interval_s
        n = self._suppressed.pop(key, 0)
        log.log(level, msg + " suppressed_since_last=%d", *args, n, exc_info=exc_info)
        return True


def escape_log(value: object) -> str:
    """A value safe inside one text log line: control characters (newlines too) are escaped."""
    text = str(value)
    if text.isprintable():
        return text
    return text.encode("unicode_escape").decode("ascii")
