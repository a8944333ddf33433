"""The simulated engine's timeline: a pure FCFS model of one worker on a virtual clock.

Prefill is serial (one prefill at a time owns the GPU's compute), at most `max_batch` requests run
(prefill + decode), the rest wait. Times come from `SimModel`, never from the wall clock, so the
numbers do not depend on how loaded the machine running the demo is (docs/end-to-end.md).
"""
from __future__ import annotations

import bisect
from collections import deque

from sim.api import SimModel


class Slot:
    __slots__ = ("arrival", "start", "first", "finish")

    def __init__(self, arrival: float, start: float, first: float, finish: float) -> None:
        self.arrival = arrival
        self.start = start
        self.first = first
        self.finish = finish


class QueueFull(Exception):
    pass


class Schedule:
    """Admission on a virtual timeline. Requests normally reach the engine in arrival order; when
    one comes late (a slow network or a busy router delivered it after later arrivals), it takes
    the first gap in the prefill engine's timeline after its own arrival that fits it, instead of
    queueing behind requests that arrived after it (what a FCFS engine would have done had it
    arrived on time). Committed requests are never moved."""

    __slots__ = ("sim", "busy", "slots", "last_arrival", "horizon_s")

    def __init__(self, sim: SimModel, horizon_s: float = 3600.0) -> None:
        self.sim = sim
        self.busy: list[tuple[float, float]] = []  # prefill engine intervals, sorted by start
        self.slots: deque[Slot] = deque()
        self.last_arrival = 0.0
        self.horizon_s = horizon_s  # entries that finished this long before the latest arrival are dropped

    @property
    def prefill_free(self) -> float:
        return self.busy[-1][1] if self.busy else 0.0

    def queued_at(self, t: float) -> int:
        return sum(1 for s in self.slots if s.arrival <= t < s.start)

    def running_at(self, t: float) -> int:
        return sum(1 for s in self.slots if s.start <= t < s.finish)

    def backlog_at(self, t: float) -> float:
        """Virtual seconds of committed work ahead of a request arriving at `t` (prefill engine
        and batch slots): what a router's load term should see."""
        return self._slot_free(max(t, self.prefill_free)) - t

    def free_at(self) -> float:
        """Virtual time the committed work ends (prefill engine, then a batch slot), whatever the clock."""
        return self._slot_free(self.prefill_free)

    def _engine_free(self, t: float, d: float) -> float:
        """First time >= t from which the prefill engine is idle for `d` seconds."""
        i = bisect.bisect_left(self.busy, (t, t)) - 1
        i = max(i, 0)
        cur = t
        for s, e in self.busy[i:]:
            if e <= cur:
                continue
            if s - cur >= d:
                break
            cur = max(cur, e)
        return cur

    def _slot_free(self, t: float) -> float:
        """First time >= t with fewer than max_batch requests running."""
        busy = sorted(s.finish for s in self.slots if s.start <= t < s.finish)
        k = self.sim.max_batch
        return busy[len(busy) - k] if len(busy) >= k else t

    def earliest_start(self, arrival: float, d: float = 0.0) -> float:
        t = arrival
        for _ in range(64):  # each round moves t forward to an engine gap, then to a free slot
            t1 = self._engine_free(t, d)
            t2 = self._slot_free(t1)
            if t2 == t1:
                return t1
            t = t2
        return max(t, self.prefill_free)

    def admit(self, arrival: float, load_s: float, prefill_s: float, output_tokens: int) -> Slot:
        """Place one request; raises QueueFull when `max_queue` requests already wait."""
        if self.queued_at(arrival) >= self.sim.max_queue:
            raise QueueFull(f"{self.sim.max_queue} requests already waiting")
        d = load_s + prefill_s
        start = self.earliest_start(arrival, d)
        first = start + d
        finish = first + output_tokens * self.sim.decode_s_per_token
        bisect.insort(self.busy, (start, first))
        slot = Slot(arrival, start, first, finish)
        self.slots.append(slot)
        self.last_arrival = max(self.last_arrival, arrival)
        cut = self.last_arrival - self.horizon_s
        while self.slots and self.slots[0].finish < cut:
            self.slots.popleft()
        while self.busy and self.busy[0][1] < cut:
            self.busy.pop(0)
        return slot

    def cancel(self, slot: Slot, at: float) -> bool:
        """The request's client went away at virtual time `at`: it gives back what it has not used
        (its wait, its prefill interval if that had not ended, its batch slot). Other committed
        requests keep their places; later admissions see the freed capacity. False when the request
        had already finished by `at`."""
        if at >= slot.finish:
            return False
        cut = max(at, slot.arrival)
        if cut < slot.first:  # waiting or in prefill: its engine interval goes or ends at the cut
            i = bisect.bisect_left(self.busy, (slot.start, slot.first))
            if i < len(self.busy) and self.busy[i] == (slot.start, slot.first):
                if cut <= slot.start:
                    del self.busy[i]
                else:
                    self.busy[i] = (slot.start, cut)
            slot.start = min(slot.start, cut)
            slot.first = cut
        slot.finish = cut
        return True
