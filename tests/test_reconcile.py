"""The reconciliation policy (indexer/reconcile.py, docs/service.md): pure, time passed in.
Examples of each rule, then properties over random input sequences checked against a model
written from the policy table."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import reconcile
from indexer.core import native as native_core
from indexer.reconcile import (
    GAP_LOST,
    GAP_REPLAYED,
    NOTHING,
    ORPHANS_ECHO,
    ORPHANS_LOST,
    RESTARTED,
    LivenessPolicy,
    StreamState,
    batch_rank,
    cleared_in,
    on_batch,
    on_gap,
    on_restart,
    on_tick,
    whole_batch_drop,
)


def test_status_machine_with_heartbeats() -> None:
    p = LivenessPolicy(stale_after_s=10, remove_after_s=100, silent_engine_factor=3, resync_hold_s=5)
    w = StreamState("a", 0.0)
    assert w.status(1.0, p) == "connecting"
    # No heartbeat seen yet: judged by the looser deadline (10 * 3).
    assert w.status(25.0, p) == "connecting" and w.status(31.0, p) == "stale"
    assert on_batch(w, 0, 2.0, p, heartbeat=True) is NOTHING
    assert w.status(2.0, p) == "live" and w.status(12.5, p) == "stale"
    assert on_gap(w, 1, 1, 3.0, p, recovered=False) is GAP_LOST
    assert w.status(4.0, p) == "resyncing" and w.status(8.1, p) == "live"
    changes, expired = on_tick([w], 4.0, p)
    assert changes == [("a", "connecting", "resyncing")] and expired == []
    assert on_tick([w], 4.5, p) == ([], [])
    assert on_tick([w], 104.0, p)[1] == ["a"]  # silent past remove_after, and known to heartbeat


def test_engines_without_heartbeats_are_never_expired() -> None:
    p = LivenessPolicy(stale_after_s=1, remove_after_s=2)
    w = StreamState("vllm", 0.0)
    on_batch(w, 0, 0.0, p)
    changes, expired = on_tick([w], 1e6, p)
    assert expired == [] and changes == [("vllm", "connecting", "stale")]


def test_orphans_clear_once_then_only_extend_resyncing() -> None:
    p = LivenessPolicy(resync_hold_s=5)
    w = StreamState("a", 0.0)
    assert on_batch(w, 0, 1.0, p, orphans=True) is ORPHANS_LOST  # clean stream: clear
    assert on_batch(w, 1, 2.0, p, orphans=True) is ORPHANS_ECHO  # echo of the same loss: keep what was rebuilt
    assert w.resyncs == 1 and w.status(6.5, p) == "resyncing"
    on_batch(w, 2, 3.0, p, cleared=True)  # AllBlocksCleared: a reset or a snapshot answer
    assert w.clean and w.resync_until is None
    assert on_batch(w, 3, 7.0, p, orphans=True) is ORPHANS_LOST
    assert on_restart(w, 8.0) is RESTARTED
    assert w.clean and w.last_seq is None and w.restarts == 1


def test_cleared_and_orphans_in_one_batch_is_a_new_loss() -> None:
    """The clear comes first in the batch, so orphans after it are a loss on a clean stream."""
    p = LivenessPolicy()
    w = StreamState("a", 0.0)
    on_gap(w, 0, 3, 1.0, p, recovered=False)
    assert on_batch(w, 4, 2.0, p, cleared=True, orphans=True) is ORPHANS_LOST


def test_decisions_say_what_to_do() -> None:
    assert GAP_LOST.clear and GAP_LOST.resync == "replay_cannot_cover"
    assert ORPHANS_LOST.clear and ORPHANS_LOST.resync == "orphans_expired"
    assert RESTARTED.clear and RESTARTED.restart and RESTARTED.resync is None
    assert not GAP_REPLAYED.clear and GAP_REPLAYED.replayed
    assert not ORPHANS_ECHO.clear and ORPHANS_ECHO.drop == "orphans_after_resync"
    assert not NOTHING.clear and NOTHING.resync is None and NOTHING.drop is None
    assert "clear=True" in repr(GAP_LOST)


def test_outcome_readers() -> None:
    assert whole_batch_drop({"decode_invalid": 1}) == "decode_invalid"
    assert whole_batch_drop({"decode_invalid": 0, "unknown_medium": 3}) is None
    assert cleared_in({("cleared", "", "cleared"): 1}) and not cleared_in({("stored", "gpu", "new"): 2})
    assert not cleared_in({("cleared", "", "cleared"): 0})
    assert batch_rank(3, 1, 0) == 3 and batch_rank(None, 1, 0) == 1 and batch_rank(-1, None, 7) == 7
    assert batch_rank(True, None, 2) == 2  # a bool is not a rank


# --- properties -------------------------------------------------------------------------------------

# One input: ("batch", heartbeat, cleared, orphans) | ("gap", recovered, size) | ("restart",) | ("tick",)
_inputs = st.lists(st.one_of(
    st.tuples(st.just("batch"), st.booleans(), st.booleans(), st.booleans()),
    st.tuples(st.just("gap"), st.booleans(), st.integers(1, 5)),
    st.tuples(st.just("restart")),
    st.tuples(st.just("tick")),
), max_size=60)


def _drive(s: StreamState, inputs: list[tuple], policy: LivenessPolicy, dt: float) -> list[reconcile.Decision]:
    out = []
    now = 0.0
    seq = 0
    for inp in inputs:
        now += dt
        if inp[0] == "batch":
            out.append(on_batch(s, seq, now, policy, heartbeat=inp[1], cleared=inp[2], orphans=inp[3]))
            seq += 1
        elif inp[0] == "gap":
            out.append(on_gap(s, seq, seq + inp[2] - 1, now, policy, recovered=inp[1]))
            seq += inp[2]
        elif inp[0] == "restart":
            out.append(on_restart(s, now))
            seq = 0
        else:
            on_tick([s], now, policy)
    return out


@given(_inputs)
@settings(max_examples=300, deadline=None)
def test_policy_matches_its_table(inputs: list[tuple]) -> None:
    """A model of the policy table: clean/unclean, which input clears, resyncs, drops."""
    policy = LivenessPolicy(resync_hold_s=3.0)
    s = StreamState("w", 0.0)
    decisions = _drive(s, inputs, policy, 1.0)
    clean = True
    resyncs = clears = 0
    it = iter(decisions)
    for inp in inputs:
        if inp[0] == "tick":
            continue
        d = next(it)
        if inp[0] == "batch":
            _, _hb, cleared, orphans = inp
            clean = clean or cleared
            if orphans and clean:
                assert d is ORPHANS_LOST
                clean = False
            elif orphans:
                assert d is ORPHANS_ECHO
            else:
                assert d is NOTHING
        elif inp[0] == "gap":
            assert d is (GAP_REPLAYED if inp[1] else GAP_LOST)
            clean = clean and inp[1]
        else:
            assert d is RESTARTED
            clean = True
        resyncs += d.resync is not None
        clears += d.clear
    assert s.clean == clean
    assert s.resyncs == resyncs
    assert s.restarts == sum(1 for i in inputs if i[0] == "restart")
    assert s.gaps == sum(1 for i in inputs if i[0] == "gap")
    assert s.replays == sum(1 for i in inputs if i[0] == "gap" and i[1])
    assert s.missing == sum(i[2] for i in inputs if i[0] == "gap" and not i[1])
    assert clears == resyncs + s.restarts  # every clear is a resync or a restart, and vice versa


@given(_inputs, st.floats(0.1, 20.0))
@settings(max_examples=200, deadline=None)
def test_liveness_is_a_function_of_the_last_message(inputs: list[tuple], dt: float) -> None:
    """Status only depends on silence, heartbeats and the resync window, never on the path there;
    a worker that never heartbeat is never expired; the last tick's status is the reported one."""
    policy = LivenessPolicy(stale_after_s=5.0, remove_after_s=30.0, silent_engine_factor=2.0, resync_hold_s=4.0)
    s = StreamState("w", 0.0)
    _drive(s, inputs, policy, dt)
    now = dt * len(inputs)
    st_now = s.status(now, policy)
    silent = now - (s.last_msg_at if s.last_msg_at is not None else 0.0)
    deadline = policy.stale_after_s * (1 if s.heartbeats else policy.silent_engine_factor)
    if silent > deadline:
        assert st_now == "stale"
    elif s.resync_until is not None and now < s.resync_until:
        assert st_now == "resyncing"
    else:
        assert st_now == ("connecting" if s.last_msg_at is None else "live")
    later = now + 1e6
    assert s.expired(later, policy) == (s.heartbeats > 0)
    if inputs and inputs[-1][0] == "tick":
        assert s.reported_status == st_now


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.none() | st.floats(0, 100), st.integers(0, 2),
                          st.none() | st.floats(0, 100)), max_size=12),
       st.floats(0, 200), st.floats(0.5, 20), st.floats(1, 8))
def test_statuses_equal_each_status(rows, now, stale_after, factor) -> None:
    # The /score answer's inlined loop is the per-state rule, state by state, in every condition.
    policy = LivenessPolicy(stale_after_s=stale_after, remove_after_s=1000, silent_engine_factor=factor)
    states = []
    for i, (registered, last_msg, heartbeats, resync_until) in enumerate(rows):
        s = StreamState(f"w{i}", registered)
        s.last_msg_at, s.heartbeats, s.resync_until = last_msg, heartbeats, resync_until
        states.append(s)
    assert reconcile.statuses(states, now, policy) == [s.status(now, policy) for s in states]
    for i, s in enumerate(states):
        s.last_seq = None if i % 3 == 0 else i * 7
    assert reconcile.status_columns(states, now, policy) == ([s.status(now, policy) for s in states],
                                                             [s.last_seq for s in states])


class _SeqProperty(StreamState):
    """A state whose last_seq is not a plain slot: the C columns decline it."""

    __slots__ = ()

    @property  # type: ignore[override]
    def last_seq(self) -> int:
        return 41

    @last_seq.setter
    def last_seq(self, v: object) -> None:
        pass


@pytest.mark.skipif(native_core.select(None) is None, reason="native module not built, or KVATLAS_PURE_PYTHON")
def test_status_columns_in_c_and_what_it_declines() -> None:
    """The C loop (indexer/_native/answer.c) serves when built; a state or time it does not read
    plainly (an int time, a property for a slot, an unset slot) takes the Python loop, same columns."""
    from indexer import reconcile as rc
    assert rc._native_columns is not None  # the C module is built wherever the suite runs
    policy = LivenessPolicy(stale_after_s=5.0, remove_after_s=1000, silent_engine_factor=2.0)
    plain = [StreamState("a", 0.0), StreamState("b", 1.0)]
    plain[1].last_msg_at, plain[1].last_seq = 9.0, 3
    want = ([s.status(10.0, policy) for s in plain], [s.last_seq for s in plain])
    assert rc._native_columns(plain, 10.0, 5.0, 10.0, rc._STATUS_NAMES) == want
    odd = StreamState("c", 2)  # an int time: C declines, Python judges
    prop = _SeqProperty("d", 3.0)
    unset = StreamState("e", 4.0)
    del unset.resync_until
    for states in ([*plain, odd], [*plain, prop]):
        assert rc._native_columns(states, 10.0, 5.0, 10.0, rc._STATUS_NAMES) is None
        assert rc.status_columns(states, 10.0, policy) == ([s.status(10.0, policy) for s in states],
                                                           [s.last_seq for s in states])
    assert rc._native_columns([*plain, unset], 10.0, 5.0, 10.0, rc._STATUS_NAMES) is None
    assert rc.status_columns(plain, 10, policy) == want  # an int `now`: the Python loop
    ints = LivenessPolicy(stale_after_s=5, remove_after_s=1000, silent_engine_factor=2)  # int limits: exact as floats
    assert rc.status_columns(plain, 10.0, ints) == want
    assert rc._exact_float(5) == 5.0 and rc._exact_float((1 << 53) + 1) is None and rc._exact_float(True) is None


class _OwnLookup(StreamState):
    """A state with its own attribute lookup: the C columns decline its type."""

    __slots__ = ()

    def __getattribute__(self, name: str) -> object:
        return object.__getattribute__(self, name)


@pytest.mark.skipif(native_core.select(None) is None, reason="native module not built, or KVATLAS_PURE_PYTHON")
def test_status_columns_decline_an_own_attribute_lookup() -> None:
    from indexer import reconcile as rc
    states = [StreamState("a", 0.0), _OwnLookup("b", 1.0)]
    assert rc._native_columns(states, 10.0, 5.0, 10.0, rc._STATUS_NAMES) is None
    policy = LivenessPolicy(stale_after_s=5.0, remove_after_s=1000, silent_engine_factor=2.0)
    assert rc.status_columns(states, 10.0, policy) == ([s.status(10.0, policy) for s in states], [None, None])
