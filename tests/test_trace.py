"""Trace reading, the conversation-preserving slice and deterministic token expansion."""
from __future__ import annotations

import numpy as np
import pytest

from router.trace import (DEFAULT_TRACE, TokenExpander, TraceError, load_trace, multi_turn,
                                     parse_trace, slice_conversations)


def test_bundled_trace_ships_and_parses() -> None:
    assert DEFAULT_TRACE.exists() and (DEFAULT_TRACE.parent / "README.md").exists()
    reqs = load_trace()
    assert len(reqs) == 3993 and reqs[0].arrival_s == 0.0
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in reqs)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))


def test_equal_hash_ids_expand_to_equal_tokens_and_prefixes_are_shared() -> None:
    a, b = parse_trace(['{"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [7, 8, 9]}',
                        '{"timestamp": 5, "input_length": 1024, "output_length": 3, "hash_ids": [7, 8]}'])
    ex = TokenExpander()
    ta, tb = ex.tokens(a), ex.tokens(b)
    assert len(ta) == 1100 and len(tb) == 1024 and ta.dtype == np.uint32
    assert np.array_equal(ta[:1024], tb)
    assert np.array_equal(TokenExpander().tokens(a), ta)  # deterministic across expanders
    c, = parse_trace(['{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [9]}'])
    assert not np.array_equal(ex.tokens(c), ta[:512])  # different id, different tokens
    assert b.arrival_s == 0.005


@pytest.mark.parametrize("line, msg", [
    ('{"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [1]}', "needs 3"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 3, "hash_ids": []}', "positive"),
    ('{"timestamp": 0, "input_length": 10}', "line 1"),
    ("not json", "line 1"),
])
def test_bad_lines_name_the_line(line: str, msg: str) -> None:
    with pytest.raises(TraceError, match=msg):
        parse_trace([line])


def test_empty_or_missing_trace_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(TraceError, match="empty"):
        parse_trace(["", "  "])
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.jsonl")


def test_slice_keeps_whole_conversations_in_time_order_at_the_full_rate() -> None:
    reqs = load_trace()
    s = slice_conversations(reqs, 300, seed=1)
    assert len(s) == 300 and [r.index for r in s] == list(range(300))
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(s, s[1:]))
    roots = {r.hash_ids[0] for r in s}
    full = [r for r in reqs if r.hash_ids[0] in roots]
    assert len(full) - len(s) <= max(len(r) for r in [[x for x in full if x.hash_ids[0] == h] for h in roots])
    rate_full = len(reqs) / reqs[-1].arrival_s
    rate_slice = len(s) / s[-1].arrival_s
    assert 0.5 < rate_slice / rate_full < 2.0
    assert slice_conversations(reqs, 300, seed=1) == s  # deterministic
    assert slice_conversations(reqs, 300, seed=2) != s
    # whole conversations keep reuse that a contiguous window loses
    def reuse(rs) -> float:
        seen: set[int] = set()
        hit = tot = 0
        for r in rs:
            hit += sum(h in seen for h in r.hash_ids)
            tot += len(r.hash_ids)
            seen.update(r.hash_ids)
        return hit / tot
    assert reuse(s) > 2 * reuse(reqs[:300])


def test_builtin_multi_turn_generator_extends_prefixes() -> None:
    reqs = multi_turn(conversations=5, turns=3, seed=3)
    assert len(reqs) == 15 and reqs == multi_turn(conversations=5, turns=3, seed=3)
    assert all(-(-r.input_length // 512) == len(r.hash_ids) for r in reqs)
    by_conv: dict[tuple[int, ...], int] = {}
    for r in reqs:  # each later turn starts with an earlier turn's blocks
        by_conv[r.hash_ids] = 1
    extended = sum(1 for r in reqs if any(r.hash_ids[:len(k)] == k and len(k) < len(r.hash_ids) for k in by_conv))
    assert extended == 10


def test_builtin_chat_is_bursty_shared_prefix_multi_turn_and_seeded() -> None:
    from router.trace import bursty_chat, requests_for

    for seed in (0, 1, 7):
        reqs = bursty_chat(300, seed=seed)
        assert reqs == bursty_chat(300, seed=seed) and reqs != bursty_chat(300, seed=seed + 1)
        assert len(reqs) == 300 and [r.index for r in reqs] == list(range(300))
        assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
        system = reqs[0].hash_ids[:8]
        assert all(r.hash_ids[:8] == system for r in reqs)  # one system prompt, every conversation
        assert sum(r.input_length for r in reqs) / len(reqs) >= 10_000
        # multi-turn: a later turn's blocks extend an earlier request's (the same conversation)
        by_doc: dict[int, list] = {}
        for r in reqs:
            by_doc.setdefault(r.hash_ids[8], []).append(r)
        multi = [turns for turns in by_doc.values() if len(turns) > 1]
        assert len(multi) >= len(by_doc) // 2
        for turns in multi:
            for a, b in zip(turns, turns[1:]):
                assert b.hash_ids[:len(a.hash_ids)] == a.hash_ids and len(b.hash_ids) > len(a.hash_ids)
        # bursty: half the gaps are under 0.2 s, yet the trace spans tens of seconds
        gaps = sorted(b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:]))
        assert gaps[len(gaps) // 2] < 0.2 and reqs[-1].arrival_s > 30
    assert requests_for("builtin-chat", 50, seed=3) == bursty_chat(50, seed=3)
    with pytest.raises(ValueError):
        bursty_chat(0)
