"""Property test: random hybrid producer histories (all three tiers, copies acked in random order,
evictions per component, default or opt-in component events) feed KVIndex — on the accelerator
through raw payloads and on the pure core through typed batches — and after every step the index's
device_blocks / cached_blocks equal the producer's own device / best usable lengths (opt-in events),
or never under-report them (default events: KV blocks only)."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.index import KVIndex
from schemas.codec import encode_batch
from schemas.events import KVEventBatch
from support.hybrid_history import P, History, ops

M = "m"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["mamba", "swa", "dsa"]), opt_in=st.booleans(), seq=ops(45), seed=st.integers(0, 2**16))
def test_index_equals_the_producers_usable_prefix(family, opt_in, seq, seed) -> None:
    h = History(family, opt_in, seed)
    native, pure = KVIndex(native=True), KVIndex(native=False)
    for ix in (native, pure):
        ix.ensure_model(M, P)
    try:
        for kind, a, b in seq:
            tokens, events = h.step(kind, a, b)
            batch = KVEventBatch(h.now, events)
            if batch.events:
                native.apply_payload(M, "w", 0, encode_batch(batch))
                pure.apply(M, "w", 0, batch)
            for t in h.bases + [tokens]:
                dev, best = h.usable(t)
                rows = [ix.score(M, t).workers for ix in (native, pure)]
                assert rows[0] == rows[1]
                got = (rows[0][0].device_blocks, rows[0][0].cached_blocks) if rows[0] else (0, 0)
                if opt_in or family == "dsa":
                    assert got == (dev, best), (t, family, opt_in)
                    if family != "dsa" and rows[0]:
                        assert rows[0][0].kv_blocks is not None and rows[0][0].kv_blocks >= best
                else:  # KV blocks only: the index cannot see tombstones, but never under-reports
                    assert got[0] >= dev and got[1] >= best, (t, family)
    finally:
        h.close()
