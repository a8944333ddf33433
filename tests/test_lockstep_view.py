"""router/proxy/lockstep.py without processes: a request's virtual arrival from its body, and the
router's own in-flight count on the virtual clock (a send counts until its simulated end)."""
from __future__ import annotations

import httpx

from router.proxy.lockstep import Lockstep, arrival_of


def test_arrival_of_takes_finite_non_negative_numbers_only() -> None:
    assert arrival_of({"kvatlas_arrival_s": 3}) == 3.0 and arrival_of({"kvatlas_arrival_s": 0.5}) == 0.5
    for bad in (None, "1", True, -1.0, float("inf"), float("nan"), [1]):
        assert arrival_of({"kvatlas_arrival_s": bad}) is None
    assert arrival_of({}) is None


def test_inflight_counts_sends_until_their_simulated_end() -> None:
    ls = Lockstep({"a": "http://x", "b": "http://y"}, httpx.AsyncClient(), None)
    ls.sent("a", 1.0, {"x-kvatlas-e2e-s": "4.0"})   # ends at 5
    ls.sent("a", 2.0, {"x-kvatlas-e2e-s": "1.0"})   # ends at 3
    ls.sent("b", 2.0, {})                           # no e2e: not counted
    ls.sent("b", 2.0, {"x-kvatlas-e2e-s": "bad"})
    assert ls.inflight(2.5, ["a", "b"]) == {"a": 2, "b": 0}
    assert ls.inflight(3.0, ["a", "b"]) == {"a": 1, "b": 0}  # ended exactly at 3: not in flight
    assert ls.inflight(5.0, ["a"]) == {"a": 0}
