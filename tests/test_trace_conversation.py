"""`builtin-conversation` (router_api.router.trace.conversations): long multi-turn conversations whose
every turn is the previous prompt + its answer + a new message, arriving a think time after the
previous answer; a few system prompts of skewed popularity; seeded."""
from __future__ import annotations

import pytest

from router_api.router.trace import (BUILTIN_TRACES, TRACE_BLOCK_TOKENS, bursty_chat, conversations,
                                     requests_for)




def test_conversation_turns_extend_previous_prompt_plus_answer_after_think_time() -> None:
    reqs = conversations(300, seed=0)
    assert len(reqs) == 300 and [r.index for r in reqs] == list(range(300))
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
    # conversations: a later request whose blocks extend an earlier one's is its next turn
    prev_of: dict[int, object] = {}
    last_by_prefix: dict[tuple[int, ...], object] = {r.hash_ids: r for r in reqs}
    turns_of_next = 0
    for r in reqs:
        for k in range(len(r.hash_ids) - 1, 0, -1):
            p = last_by_prefix.get(r.hash_ids[:k])
            if p is not None and p is not r and p.arrival_s < r.arrival_s:
                prev_of[r.index] = p
                break
    for i, p in prev_of.items():
        r = reqs[i]
        added = len(r.hash_ids) - len(p.hash_ids)
        answer_blocks = -(-p.output_length // TRACE_BLOCK_TOKENS)
        assert answer_blocks + 1 <= added <= answer_blocks + 3  # the answer, then a 1-3 block message
        assert r.arrival_s - p.arrival_s >= p.output_length * 0.02 + 2.0 - 1e-6  # after the answer + think
        turns_of_next += 1
    assert turns_of_next >= 200  # most requests are a later turn of a conversation
    # long contexts
    mean = sum(r.input_length for r in reqs) / len(reqs)
    assert mean >= 15_000 and max(r.input_length for r in reqs) >= 30_000
    assert all(64 <= r.output_length <= 512 for r in reqs)


def test_conversations_share_a_few_system_prompts_with_skewed_popularity() -> None:
    reqs = conversations(300, seed=1)
    firsts = [r for r in reqs if not any(o.arrival_s < r.arrival_s and r.hash_ids[:len(o.hash_ids)] == o.hash_ids
                                         for o in reqs)]
    heads = {}
    for r in firsts:
        heads.setdefault(r.hash_ids[0], []).append(r)
    assert 2 <= len(heads) <= 4  # a few system prompts
    sizes = sorted((len(v) for v in heads.values()), reverse=True)
    assert sizes[0] > sizes[-1]  # not uniform
    # unlike builtin-chat: no bursts — conversations open one at a time
    starts = sorted(r.arrival_s for r in firsts)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert sum(1 for g in gaps if g < 0.1) < len(gaps) // 4


def test_conversations_are_seeded_and_reachable_as_a_builtin_trace() -> None:
    a = conversations(120, seed=4)
    assert a == conversations(120, seed=4) and a != conversations(120, seed=5)
    assert "builtin-conversation" in BUILTIN_TRACES
    assert requests_for("builtin-conversation", 120, seed=4) == a
    assert len(requests_for("builtin-conversation", 0, seed=4)) == 300
    assert a != bursty_chat(120, seed=4)
    with pytest.raises(ValueError):
        conversations(0)
