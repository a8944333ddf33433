"""Property test over random hybrid histories (all three tiers, copies acked in random order,
evictions per component): after every step the producer's own device / best match lengths equal
what the brute-force model (tests/support/hybrid_model.py) computes from the emitted opt-in
events, and with default events the model never under-reports KV blocks."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.hybrid_history import P, History, ops
from support.hybrid_model import HybridModel


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["mamba", "swa", "dsa"]), opt_in=st.booleans(), seq=ops(50), seed=st.integers(0, 2**16))
def test_match_lengths_equal_the_event_model(family, opt_in, seq, seed) -> None:
    h = History(family, opt_in, seed)
    cache = h.cache
    model = HybridModel(P)
    try:
        for kind, a, b in seq:
            tokens, events = h.step(kind, a, b)
            model.apply("w", events)
            assert cache.audit(exact=False) == []
            for t in h.bases + [tokens]:
                dev, best = h.usable(t)
                mdev, mbest = model.usable("w", t)
                if opt_in or family == "dsa":
                    assert (dev, best) == (mdev, mbest), (t, family)
                    m = cache.match_prefix(t)
                    if not m.loading:  # full-attention semantics count loading pages as device
                        assert (m.device_len // P, m.best_len // P) == (dev, best)
                else:
                    assert mbest >= best and mdev >= dev  # KV-only view: never under-reports
                    assert model.workers["w"].kv_blocks(t, P) >= best if "w" in model.workers else best == 0
    finally:
        h.close()
