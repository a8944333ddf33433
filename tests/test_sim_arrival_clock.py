"""The simulated worker's load as a replay sees it: once requests carry `kvatlas_arrival_s`, the load
under vLLM's gauge names is read on the replay's clock (the latest arrival plus the wall time since),
not on the worker's own clock, which started before the replay and would show every queue drained."""
from __future__ import annotations

from sim.engine import VirtualClock
from sim.openai import ArrivalClock


def test_the_load_clock_follows_explicit_arrivals() -> None:
    own = VirtualClock(speed=10.0)
    own.t0 -= 100.0  # the worker has run 1,000 virtual seconds before the replay starts
    clock = ArrivalClock(own)
    assert clock.now() >= 1000.0  # no explicit arrival yet: the worker's own clock
    clock.saw(5.0)
    assert 5.0 <= clock.now() < 50.0  # the replay's present, moving on at the worker's speed
    clock.saw(3.0)  # an earlier arrival (another replica's request in flight) does not move it back
    assert clock.now() >= 5.0
    clock.saw(8.0)
    assert 8.0 <= clock.now() < 50.0
