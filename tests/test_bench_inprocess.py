"""`bench/bench_inprocess.py` and its Mooncake-shaped trace: the trace has the published shape, and the
driver's kvatlas replays (1 thread: every lookup; 2 threads on a sharded index: the final state) equal
the reference cluster's residency. Correctness only: nothing here is timed."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from bench import bench_inprocess as bi  # noqa: E402
from bench.support import mooncake_trace as mt  # noqa: E402

SMALL = mt.Shape(n_requests=600)
CAP = 120  # small enough that evictions (BlockRemoved) happen within 600 requests


def test_trace_has_the_mooncake_shape() -> None:
    recs = mt.generate(SMALL, seed=3)
    assert recs == mt.generate(SMALL, seed=3) and recs != mt.generate(SMALL, seed=4)  # seeded
    seen = -1
    for prev, r in zip([None] + recs, recs):
        assert len(r.hash_ids) == -(-r.input_length // mt.BLOCK)  # one id per 512-token block, last partial
        assert 0 < r.input_length <= SMALL.max_input and r.output_length >= 1
        assert prev is None or r.timestamp >= prev.timestamp
        for h in r.hash_ids:  # ids are handed out in order of first appearance
            if h > seen:
                assert h == seen + 1
                seen = h
    assert recs[-1].timestamp <= SMALL.duration_ms
    assert 0.3 < mt.prefix_reuse(recs) < 0.9  # heavy sharing, not all shared


def test_one_thread_answers_equal_the_reference() -> None:
    recs = mt.generate(SMALL, seed=1)
    p = bi.prepare(recs, with_dynamo=False, keep_expected=True, capacity=CAP)
    assert sum(len(s.removed) for s in p.steps) > 0  # the eviction path is exercised
    answers: list = []
    bi.replay_kvatlas(p, 1, answers)
    assert len(answers) == len(p.steps)
    for s, res in zip(p.steps, answers):
        assert bi.kvatlas_matches(res) == s.expected
    assert any(max(s.expected) > 0 for s in p.steps)  # lookups do hit


def test_two_threads_end_in_the_reference_state() -> None:
    recs = mt.generate(SMALL, seed=2)
    p = bi.prepare(recs, with_dynamo=False, capacity=CAP)
    _, ix = bi.replay_kvatlas(p, 2)
    assert ix.shard_count == 2
    truth = mt.final_residency(recs, bi.WORKERS, CAP)
    stats = ix.worker_stats(bi.MODEL)
    for w in range(bi.WORKERS):  # each worker's steps run on one thread in order: the end state is exact
        assert stats[(bi.worker_name(w), 0)]["gpu"] == len(truth[w])
    ref = mt.Cluster(bi.WORKERS, CAP)
    ref.lru = [dict.fromkeys(t) for t in truth]  # type: ignore[misc]
    for s, keys in zip(p.steps, p.keys):
        assert bi.kvatlas_matches(ix.score_keys(bi.MODEL, keys)) == ref.matches(s.blocks)
