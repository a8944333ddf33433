"""The producer benches' two timed phases per request: the prefix match, and the insert (allocation,
eviction, insert and event encoding), summed over a run."""
from __future__ import annotations


class MatchInsertClock:
    """Per request `add(t0, t1, t2)`: match from t0 to t1, insert from t1 to t2; each insert time also
    kept in `times` when given (the latency percentiles)."""

    __slots__ = ("match_s", "insert_s", "times")

    def __init__(self, times: list[float] | None = None) -> None:
        self.match_s = 0.0
        self.insert_s = 0.0
        self.times = times

    def add(self, t0: float, t1: float, t2: float) -> None:
        self.match_s += t1 - t0
        self.insert_s += t2 - t1
        if self.times is not None:
            self.times.append(t2 - t1)

    def rates(self, n: int) -> tuple[float, float]:
        """(inserts per second, matches per second) over `n` requests."""
        return n / self.insert_s, n / self.match_s
