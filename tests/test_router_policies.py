"""Routing policies and the report (pure), and the worker's virtual schedule."""
from __future__ import annotations

import pytest

from sim.schedule import QueueFull, Schedule
from router_api.router.policies import POLICIES, RouteInput, ScoreRow, make_policy
from router_api.router.report import format_table, mismatch_cause, quantile, summarize
from sim.api import RequestRecord, SimModel, Tokens

W = ["a", "b", "c"]
SIM = SimModel()


def inp(tokens: int = 2048, scores=None, backlog=None, inflight=None, keys=None) -> RouteInput:
    keys = keys if keys is not None else [bytes([i]) for i in range(tokens // 512)]
    return RouteInput(tokens, keys, 512, scores, backlog or {}, inflight or {w: 0 for w in W})


def test_round_robin_and_random_make_no_prediction() -> None:
    rr = make_policy("round_robin", W, SIM)
    assert [rr.choose(inp()).worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    rnd = make_policy("random", W, SIM, seed=1)
    picks = {rnd.choose(inp()).worker_id for _ in range(50)}
    assert picks == set(W) and rnd.choose(inp()).predicted_cached is None


def test_least_loaded_takes_the_smallest_backlog() -> None:
    ll = make_policy("least_loaded", W, SIM)
    assert ll.choose(inp(backlog={"a": 3.0, "b": 0.5, "c": 1.0})).worker_id == "b"


def test_precise_tiered_costs_tiers_and_load_precise_gpu_ignores_lower_tiers() -> None:
    # 'a' holds the prompt on the host, 'b' on the GPU but is far behind (20 s), 'c' has nothing.
    scores = {"a": ScoreRow(0, 4, host=4), "b": ScoreRow(4, 4), "c": ScoreRow()}
    backlog = {"a": 0.1, "b": 20.0, "c": 0.0}
    t = make_policy("precise_tiered", W, SIM).choose(inp(scores=scores, backlog=backlog))
    assert t.worker_id == "a" and t.predicted_cached == 2048
    g = make_policy("precise_gpu", W, SIM).choose(inp(scores=scores, backlog=backlog))
    assert g.worker_id == "c" and g.predicted_cached == 0  # host blocks look like misses to it
    # without load, both prefer the GPU copy
    assert make_policy("precise_gpu", W, SIM).choose(inp(scores=scores)).worker_id == "b"
    assert make_policy("precise_tiered", W, SIM).choose(inp(scores=scores)).worker_id == "b"


def test_precise_kv_only_reads_kv_blocks_where_precise_tiered_reads_the_usable_prefix() -> None:
    """A hybrid worker 'a' holds 4 full-attention blocks but can resume from none (row kv 4, cached 0);
    'b' holds 2 usable blocks. The group-blind policy goes to 'a' and promises 4 blocks; precise_tiered
    goes to 'b' and promises what 'b' can use."""
    scores = {"a": ScoreRow(0, 0, kv=4), "b": ScoreRow(2, 2, kv=2), "c": ScoreRow()}
    kv_only = make_policy("precise_kv_only", W, SIM)
    tiered = make_policy("precise_tiered", W, SIM)
    d = kv_only.choose(inp(scores=scores))
    assert (d.worker_id, d.predicted_cached) == ("a", 2048)
    d = tiered.choose(inp(scores=scores))
    assert (d.worker_id, d.predicted_cached) == ("b", 1024)
    # a full-attention model's rows carry no kv_blocks: both read the same prefix
    row = ScoreRow.from_answer({"device_blocks": 1, "cached_blocks": 3, "tiers": {"gpu": 1, "host": 2}})
    assert (row.kv, row.host, row.pending) == (3, 2, 0) and kv_only.cost(inp(), row) == tiered.cost(inp(), row)
    hyb = ScoreRow.from_answer({"device_blocks": 0, "cached_blocks": 1, "tiers": {"gpu": 1}, "kv_blocks": 3,
                                "pending_blocks": 1})
    assert (kv_only.cached_blocks(hyb), tiered.cached_blocks(hyb)) == (3, 2)
    # the route report's answer refines the prediction; the group-blind one still reads kv_blocks
    assert kv_only.predicted_at_report(hyb, 1, 0) == 3 and tiered.predicted_at_report(hyb, 1, 0) == 1
    assert "precise_kv_only" in POLICIES


def test_approximate_remembers_its_own_decisions_and_balances() -> None:
    ap = make_policy("approximate", W, SIM)
    first = ap.choose(inp())
    assert first.predicted_cached == 0
    again = ap.choose(inp())
    assert again.worker_id == first.worker_id and again.predicted_cached == 2048
    other = ap.choose(inp(keys=[b"x", b"y", b"z", b"w"]))  # no match: the emptiest tree
    assert other.worker_id != first.worker_id
    # badly imbalanced load overrides the cache match
    busy = {w: 0 for w in W}
    busy[first.worker_id] = 100
    assert ap.choose(inp(inflight=busy)).worker_id != first.worker_id


def test_unknown_policy_and_empty_fleet_are_errors() -> None:
    assert len(POLICIES) == 7
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("magic", W, SIM)
    with pytest.raises(ValueError, match="at least one worker"):
        make_policy("round_robin", [], SIM)


def test_mismatch_causes_are_measured() -> None:
    # predicted 1024 of which 512 from a pending route; held only the exact 512 on arrival: unlanded
    r = RequestRecord(0, "a", 2000, 1024, 512, Tokens(gpu=512, computed=1488), 1.0, predicted_pending=512)
    assert mismatch_cause(r) == "unlanded"
    r.predicted_pending = 0
    assert mismatch_cause(r) == "evicted"
    # held on arrival what was predicted, served less: lost before it ran
    assert mismatch_cause(RequestRecord(0, "a", 2000, 1024, 1024, Tokens(gpu=512, computed=1488), 1.0)) == "lost"
    assert mismatch_cause(RequestRecord(0, "a", 2000, 512, 1024, Tokens(gpu=1024, computed=976), 1.0)) == "unseen"
    assert mismatch_cause(RequestRecord(0, "a", 2000, 512, 512, Tokens(gpu=512, computed=1488), 1.0)) is None
    assert mismatch_cause(RequestRecord(0, "a", 2000, None, 512, Tokens(gpu=512, computed=1488), 1.0)) is None


def test_pending_blocks_count_as_cached_for_precise_policies() -> None:
    # 'a' has the first 2 blocks exact and 2 more pending (an in-flight request routed there);
    # 'b' holds 3 blocks exactly. Pending makes 'a' the cheaper choice, and the prediction says so.
    scores = {"a": ScoreRow(2, 2, pending=2), "b": ScoreRow(3, 3), "c": ScoreRow()}
    for name in ("precise_tiered", "precise_gpu"):
        d = make_policy(name, W, SIM).choose(inp(tokens=2048, scores=scores))
        assert d.worker_id == "a" and d.predicted_cached == 2048 and d.predicted_pending == 1024
    # ...unless its queue outweighs the recompute (a continuing conversation's: keep_weight times)
    d = make_policy("precise_tiered", W, SIM).choose(inp(tokens=2048, scores=scores, backlog={"a": 1.0}))
    assert d.worker_id == "a"
    d = make_policy("precise_tiered", W, SIM).choose(inp(tokens=2048, scores=scores, backlog={"a": 5.0}))
    assert d.worker_id == "b" and d.predicted_cached == 1536 and d.predicted_pending == 0


def test_precise_ties_spread_new_work() -> None:
    # nothing cached anywhere, no load: not always the first worker
    p = make_policy("precise_tiered", W, SIM)
    assert [p.choose(inp(scores={})).worker_id for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_summary_counts_prediction_mismatches_by_direction() -> None:
    recs = [RequestRecord(0, "a", 1000, 512, 512, Tokens(gpu=512, computed=488), 1.0),
            RequestRecord(1, "a", 1000, 0, 512, Tokens(host=512, computed=488), 2.0),
            RequestRecord(2, "b", 1000, 512, 0, Tokens(computed=1000), 3.0),
            RequestRecord(3, "b", 1000, 0, 0, Tokens(computed=1000), 4.0),
            RequestRecord(4, "b", 1000, error="worker b: HTTP 503")]
    row = summarize("precise_tiered", 1, recs)
    assert (row.requests, row.errors, row.prefill_tokens) == (4, 1, 2976)
    assert row.hit_ratio == round(1024 / 4000, 4) and row.ttft_mean_s == 2.5 and row.ttft_p90_s == 4.0
    assert row.prediction_accuracy == 0.5 and (row.index_behind, row.index_ahead) == (1, 1)
    assert summarize("round_robin", 1, [RequestRecord(0, "a", 10, None, 0, Tokens(computed=10), 1.0)]
                     ).prediction_accuracy is None
    table = format_table([row])
    assert "precise_tiered" in table and "50.0%" in table and "1 worker held more than predicted" in table
    assert row.causes == {"unseen": 1, "evicted": 1} and row.held_accuracy == 0.5
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 0.9) == 9.0


def test_schedule_fcfs_serial_prefill_batch_slots_and_late_arrivals() -> None:
    s = Schedule(SimModel(max_batch=2, max_queue=3, decode_s_per_token=1.0))
    a = s.admit(0.0, 0.0, 5.0, 10)        # prefill 0-5, decodes to 15
    b = s.admit(1.0, 0.5, 1.0, 10)        # waits for the engine: 5-6.5, to 16.5
    assert (a.start, a.first, b.start, b.first) == (0.0, 5.0, 5.0, 6.5)
    c = s.admit(2.0, 0.0, 1.0, 0)         # both slots busy until 15
    assert c.start == 15.0 and s.queued_at(3.0) == 2 and s.running_at(3.0) == 1
    assert s.backlog_at(3.0) == 13.0  # the engine is committed until c is prefilled at 16
    assert s.free_at() == 16.0 and s.backlog_at(20.0) == 0.0  # free_at does not move with the clock
    late = Schedule(SimModel())
    x = late.admit(0.0, 0.0, 2.0, 0)
    y = late.admit(10.0, 0.0, 2.0, 0)
    z = late.admit(1.0, 0.0, 3.0, 0)      # reached the engine after y: takes the gap 2-10
    assert (x.start, y.start, z.start) == (0.0, 10.0, 2.0)
    full = Schedule(SimModel(max_batch=1, max_queue=1))
    full.admit(0.0, 0.0, 10.0, 0)
    full.admit(0.0, 0.0, 10.0, 0)
    with pytest.raises(QueueFull):
        full.admit(0.0, 0.0, 10.0, 0)


def test_a_cold_idle_worker_is_not_locked_out_by_a_shared_prefix() -> None:
    # 'a' and 'b' hold the system prompt (8 of 24 blocks) and are busy; 'c' has never seen it and is
    # idle: its extra prefill costs less than their queues, so it takes the new conversation.
    scores = {"a": ScoreRow(8, 8), "b": ScoreRow(8, 8), "c": ScoreRow()}
    d = make_policy("precise_tiered", W, SIM).choose(inp(tokens=24 * 512, scores=scores,
                                                        backlog={"a": 1.0, "b": 1.2, "c": 0.0}))
    assert d.worker_id == "c" and d.predicted_cached == 0
    # a conversation whose cache is on a busy worker stays there while a recompute elsewhere costs more
    scores = {"a": ScoreRow(22, 22), "b": ScoreRow(8, 8), "c": ScoreRow(8, 8)}
    d = make_policy("precise_tiered", W, SIM).choose(inp(tokens=24 * 512, scores=scores,
                                                        backlog={"a": 0.5, "b": 0.3, "c": 0.3}))
    assert d.worker_id == "a" and d.predicted_cached == 22 * 512


def test_a_conversation_leaves_its_cache_only_for_a_queue_many_times_its_recompute() -> None:
    # 'a' holds 27 of the prompt's 28 blocks behind a 2.6 s queue; 'b' and 'c' are idle and hold nothing.
    # On 'b' the request would start at once (TTFT 0.92 s against 2.72 s on 'a'), but 'b' would
    # recompute 0.82 s of work the fleet need not do: a continuing conversation's (one worker holds
    # more than half its prompt) recompute is charged (work_weight - 1) x keep_weight more times.
    scores = {"a": ScoreRow(0, 27, host=27), "b": ScoreRow(), "c": ScoreRow()}
    p = make_policy("precise_tiered", W, SIM)
    d = p.choose(inp(tokens=28 * 512, scores=scores, backlog={"a": 2.6}))
    assert d.worker_id == "a" and d.predicted_cached == 27 * 512
    work_a, work_b = p.cost(inp(tokens=28 * 512), scores["a"]), p.cost(inp(tokens=28 * 512), scores["b"])
    assert work_b - work_a == pytest.approx(27 * 512 / SIM.prefill_tokens_per_s - SIM.load_s(27 * 512, 0, 0))
    assert p.key(0.0, work_b, work_b - work_a) == pytest.approx(work_b * 2 + 2 * (work_b - work_a))
    # the recompute is what another worker would not do: without it (no excess) 'b' would have won
    assert p.key(0.0, work_b) < p.key(2.6, work_a) < p.key(0.0, work_b, work_b - work_a)
    # a 4 s queue, five times the recompute: it stays (the bundled trace's moves of this kind cost
    # more prefill than approximate x1 at every load of bench/bench_sweep.py)
    d = make_policy("precise_tiered", W, SIM).choose(inp(tokens=28 * 512, scores=scores, backlog={"a": 4.0}))
    assert d.worker_id == "a"
    # and at 20 s: a continuing conversation's hit is given away only for a queue there about a hundred
    # times the recompute (2 x keep_weight): a 100 s queue, the fleet far past its capacity
    d = make_policy("precise_tiered", W, SIM).choose(inp(tokens=28 * 512, scores=scores, backlog={"a": 20.0}))
    assert d.worker_id == "a"
    d = make_policy("precise_tiered", W, SIM).choose(inp(tokens=28 * 512, scores=scores, backlog={"a": 100.0}))
    assert d.worker_id in ("b", "c") and d.predicted_cached == 0
    # the shared system prompt a cold worker lacks is excess too, but only at the plain weight (no worker
    # holds more than half a new conversation's prompt), so a cold idle worker still takes a new
    # conversation from busy ones (test_a_cold_idle_worker_is_not_locked_out_by_a_shared_prefix)


def test_a_new_conversation_avoids_the_worker_recently_sent_the_most_work() -> None:
    # Equal queues now, nothing cached: the worker the policy recently sent 3 s of work holds
    # conversations that will come back; a new conversation goes elsewhere, although the tie-break
    # (least work sent ever) would pick it.
    p = make_policy("precise_tiered", W, SIM)
    scores = {w: ScoreRow() for w in W}
    p.recent["a"] = 3.0
    p.assigned.update({"a": 0.0, "b": 5.0, "c": 5.0})
    assert p.choose(inp(tokens=8 * 512, scores=scores)).worker_id != "a"
    # that work ages over `reuse_requests` decisions: thirty windows of other routing later, it is gone
    q = make_policy("precise_tiered", W, SIM)
    q.recent["a"] = 3.0
    q.assigned.update({"a": 0.0, "b": 5.0, "c": 5.0})
    held = {"a": ScoreRow(), "b": ScoreRow(7, 7), "c": ScoreRow()}
    for _ in range(int(30 * q.reuse_requests)):  # continuing conversations on 'b', nothing sent to 'a'
        q.choose(inp(tokens=8 * 512, scores=held))
    q.assigned["a"] = -1.0
    assert q.recent["a"] < 1e-9 and q.choose(inp(tokens=8 * 512, scores=scores)).worker_id == "a"
    # a continuing conversation ignores it: it stays with its cache
    r = make_policy("precise_tiered", W, SIM)
    r.recent["a"] = 3.0
    assert r.choose(inp(tokens=8 * 512, scores={"a": ScoreRow(7, 7), "b": ScoreRow(), "c": ScoreRow()}
                        )).worker_id == "a"


def test_shared_backlog_adds_every_replicas_unconfirmed_prefill() -> None:
    from router_api.router.policies import shared_backlog

    sim = SimModel()
    assert shared_backlog(sim, 0.7, ScoreRow(inflight=0, inflight_prefill=0)) == 0.7
    row = ScoreRow(inflight=2, inflight_prefill=32_000)
    assert shared_backlog(sim, 0.5, row) == pytest.approx(0.5 + 2 * sim.prefill_overhead_s + 32_000 / sim.prefill_tokens_per_s)
    # from a /score row (JSON names); the exact fields stay what the row says
    r = ScoreRow.from_answer({"device_blocks": 1, "cached_blocks": 2, "tiers": {"host": 1}, "pending_blocks": 3,
                              "pending_requests": 4, "pending_prefill_tokens": 5})
    assert (r.device, r.cached, r.pending, r.inflight, r.inflight_prefill) == (1, 2, 3, 4, 5)
