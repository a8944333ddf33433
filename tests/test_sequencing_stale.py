"""A stale live message (duplicated or reordered on the way, e.g. by a relay) is taken for a
publisher restart: the consumer clears the worker and rebuilds it from a replay. The rebuild
must also bring back the batches the live stream had already passed, because the live stream
never sends them again (docs/service.md, "Replays"). Found by the fault-injection soak: after
quiescence an index could lack the last batches of a worker whose final messages were reordered."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.sequencing import FP_WINDOW, DeliverStep, GapStep, RestartStep, SeqTracker, Step, on_live


def consume(state: set[int], steps: list[Step]) -> None:
    """What the index does with the steps: a restart or an unrecovered gap clears the worker."""
    for s in steps:
        if isinstance(s, RestartStep) or (isinstance(s, GapStep) and not s.resolution.recovered):
            state.clear()
        elif isinstance(s, DeliverStep):
            state.add(s.seq)


def buffer_fetch(published: list[int]):
    return lambda first, last: [(s, s) for s in published if s >= first]


def test_reordered_message_after_its_gap_was_replayed_keeps_later_batches() -> None:
    published = list(range(6))
    fetch = buffer_fetch(published)
    t = SeqTracker()
    state: set[int] = set()
    for s in (0, 1, 2, 3, 5, 4):  # 4 is held back and arrives after 5 (whose gap replay gave 4)
        consume(state, on_live(t, s, s, fetch))
    assert state == set(published)
    assert t.last == 5


def test_duplicated_older_message_keeps_later_batches() -> None:
    published = list(range(8))
    fetch = buffer_fetch(published)
    t = SeqTracker()
    state: set[int] = set()
    for s in (0, 1, 2, 3, 4, 5, 6, 7, 2):  # a late copy of 2
        consume(state, on_live(t, s, s, fetch))
    assert state == set(published)
    assert t.last == 7
    for s in (8, 9):  # the live stream then goes on as usual
        published.append(s)
        consume(state, on_live(t, s, s, fetch))
    assert state == set(published) and t.last == t.live_last == 9


def test_stale_seq_zero_is_caught_up_too() -> None:
    published = list(range(4))
    t = SeqTracker()
    state: set[int] = set()
    for s in (0, 1, 2, 3, 0):
        consume(state, on_live(t, s, s, buffer_fetch(published)))
    assert state == set(published) and t.last == 3


def test_real_restart_catch_up_copies_are_duplicates_not_restarts() -> None:
    """A genuine restart: the new publisher's replay holds its own later batches, which are still
    queued live; their live copies must be duplicates, not another restart."""
    t = SeqTracker()
    for s in range(10):
        on_live(t, s, ("old", s), lambda a, b: [])
    new = [(s, ("new", s)) for s in range(4)]
    steps = on_live(t, 1, ("new", 1), lambda a, b: [x for x in new if x[0] >= a])
    assert isinstance(steps[0], RestartStep)
    assert [(s.seq, s.item) for s in steps if isinstance(s, DeliverStep)] == new
    for s in (2, 3):  # the queued live copies
        assert on_live(t, s, ("new", s), lambda a, b: []) == []
    steps = on_live(t, 4, ("new", 4), lambda a, b: [])
    assert [(s.seq, s.item) for s in steps if isinstance(s, DeliverStep)] == [(4, ("new", 4))]


def test_watermark_restart_catches_up_to_the_watermark() -> None:
    """Restored from a snapshot at watermark 6, a stale copy of 3 arrives first."""
    published = list(range(7))
    t = SeqTracker(last=6)
    state = set(published)  # the snapshot
    consume(state, on_live(t, 3, 3, buffer_fetch(published)))
    assert state == set(published) and t.last == 6


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 99), st.integers(0, 3)), min_size=1, max_size=60), st.booleans())
def test_lossy_relay_converges_with_the_publisher(faults: list[tuple[int, int]], fingerprints: bool) -> None:
    """The soak's relay in miniature: each published message is dropped, duplicated, held back
    one message (reordered) or passed; the replay serves the whole buffer. Once the wire is
    drained the consumer holds everything up to the newest seq it received, with no further
    message needed to notice a hole (after quiescence nothing else comes). With fingerprints
    (what the subscriber does) a stale copy never even clears the worker."""
    published: list[int] = []
    fetch = lambda first, last: [(s, b"p%d" % s) for s in published if s >= first]  # noqa: E731
    t = SeqTracker()
    state: set[int] = set()
    held: list[int] = []
    newest = -1
    restarts = 0

    def receive(s: int) -> None:
        nonlocal restarts
        payload = b"p%d" % s
        if fingerprints and t.stale_copy(s, payload):
            return
        steps = on_live(t, s, payload, fetch)
        restarts += sum(isinstance(x, RestartStep) for x in steps)
        for x in steps:
            if isinstance(x, DeliverStep):
                t.remember(x.seq, x.item)
        consume(state, steps)

    for seq, (roll, _) in enumerate(faults):
        published.append(seq)
        wire: list[int] = []
        if roll < 8:
            pass  # dropped
        elif roll < 16:
            wire += [seq, seq]
        elif roll < 24:
            held.append(seq)
        else:
            wire.append(seq)
        if held and held[0] != seq:
            wire += held
            held = []
        for s in wire:
            newest = max(newest, s)
            receive(s)
    for s in held:
        newest = max(newest, s)
        receive(s)
    assert state == set(range(newest + 1))
    assert t.last == (newest if newest >= 0 else None)
    if fingerprints:
        assert restarts == 0


def test_stale_copy_is_told_from_a_restart_by_its_payload() -> None:
    t = SeqTracker()
    for s in range(5):
        on_live(t, s, b"", lambda a, b: [])
        t.remember(s, b"batch-%d ts=1.0" % s)
    assert t.stale_copy(3, b"batch-3 ts=1.0")
    assert not t.stale_copy(3, b"batch-3 ts=2.0")  # same seq, another payload: a restarted publisher
    assert not t.stale_copy(5, b"batch-5 ts=1.0")  # not a passed seq: the usual rules apply
    t.remember(3 + FP_WINDOW, b"x")  # the ring forgets the oldest: a restart verdict then
    assert not t.stale_copy(3, b"batch-3 ts=1.0")
    t.restart()
    assert not t.stale_copy(1, b"batch-1 ts=1.0")
