"""Hostile or absurd inputs at the edges (issue 24): u64 seqs past 2^63 in the sequencing ring,
absurd recorded timestamps in `kvatlas replay --publish`, worker names that the relay and the
indexer must judge alike, terminal escapes in the replay summary."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.sequencing import FP_WINDOW, SeqTracker

U64 = (1 << 64) - 1


@settings(max_examples=60, deadline=None)
@given(start=st.integers(min_value=(1 << 63) - 2 * FP_WINDOW, max_value=U64 - 3 * FP_WINDOW),
       n=st.integers(min_value=1, max_value=3 * FP_WINDOW))
def test_seq_tracker_fingerprints_take_any_u64_seq(start: int, n: int) -> None:
    t = SeqTracker()
    for seq in range(start, start + n):
        t.remember(seq, seq.to_bytes(8, "big"))
        t.last = t.live_last = seq
    last = start + n - 1
    for seq in range(max(start, last - FP_WINDOW + 1), last + 1):  # still in the ring: a stale copy
        assert t.stale_copy(seq, seq.to_bytes(8, "big"))
        assert not t.stale_copy(seq, b"another payload")
    t.remember(U64, b"top")
    t.last = t.live_last = U64
    assert t.classify_live(0).action.name == "RESTART" and not t.stale_copy(0, b"top")
