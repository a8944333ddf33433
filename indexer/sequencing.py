"""Per-publisher sequence tracking: the pure decision core of gap/restart handling.

No I/O, no clocks, no threads. The subscriber (the shell) feeds it the seq of every live message
and of every replayed batch, and acts on the verdicts:

live seq s, with `last` = last seq delivered and `live_last` = last seq seen on the live stream:
- `live_last` set and s <= live_last      -> RESTART (a PUB stream never goes backwards), unless
                                              the payload is a copy of the one delivered at s
                                              (`stale_copy`: a relay duplicated or reordered it)
- `live_last` unset, `last` set, s <= last -> RESTART (first live message at/below the snapshot
                                              watermark: the publisher started over)
- s <= last                                -> DUPLICATE (already delivered by a replay)
- s == expected (last+1, or 0 when unset)  -> APPLY
- s >  expected                            -> GAP [expected, s-1]

A replay only fills a gap: batches beyond the gap are left to the live stream (they are still
queued in the SUB socket; taking them from the replay would make the live copies look like
duplicates *and* lose any live batch that the replay skipped). The one exception is the catch-up
after a RESTART verdict (`on_live`): seqs the live stream had already passed never come live
again, so the rebuild takes them from the replay, as one contiguous run.
"""
from __future__ import annotations

import enum
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar, Union

T = TypeVar("T")


class Action(enum.Enum):
    APPLY = "apply"
    DUPLICATE = "duplicate"
    GAP = "gap"
    RESTART = "restart"


class Verdict:
    """What to do with one live seq. `first`/`last` are the missing range for GAP."""

    __slots__ = ("action", "first", "last")

    def __init__(self, action: Action, first: int = -1, last: int = -1) -> None:
        self.action = action
        self.first = first
        self.last = last

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Verdict) and self.action is other.action
                and self.first == other.first and self.last == other.last)

    def __repr__(self) -> str:
        if self.action is Action.GAP:
            return f"Verdict(GAP, {self.first}..{self.last})"
        return f"Verdict({self.action.name})"


_APPLY = Verdict(Action.APPLY)
_DUPLICATE = Verdict(Action.DUPLICATE)
_RESTART = Verdict(Action.RESTART)


FP_WINDOW = 256  # delivered seqs whose payload fingerprint a tracker keeps (2 x 2 KiB)


def _ring_seq(seq: int) -> int:
    """A u64 wire seq as the ring's int64 slot value (two's complement, as the C loop writes it)."""
    return seq - (1 << 64) if seq >= 1 << 63 else seq


def fingerprint(payload: bytes) -> int:
    """A payload's identity for telling a stale copy from a restarted publisher's batch at the
    same seq, in O(1) of its size: length, head (the batch's ts is there) and tail."""
    return hash((len(payload), payload[:48], payload[-16:]))


class SeqTracker:
    """Sequence state of one publisher, as seen by one subscriber."""

    __slots__ = ("last", "live_last", "_fp_seq", "_fp")

    def __init__(self, last: int | None = None) -> None:
        if last is not None and last < 0:
            raise ValueError(f"watermark must be >= 0 or None, got {last}")
        self.last: int | None = last  # last seq delivered downstream (the watermark)
        self.live_last: int | None = None  # last seq seen on the live stream
        # Fingerprints of the last FP_WINDOW delivered payloads, a ring indexed by seq % FP_WINDOW
        # (made on first use: the offline replay never needs them).
        self._fp_seq: array | None = None
        self._fp: array | None = None

    def remember(self, seq: int, payload: bytes) -> None:
        """Note the payload delivered at `seq`, so a stale copy of it can be told from a restart."""
        seqs, fps = self.rings()
        i = seq % FP_WINDOW
        seqs[i] = _ring_seq(seq)
        fps[i] = fingerprint(payload)

    def rings(self) -> tuple[array, array]:
        """The fingerprint rings `(seqs, fingerprints)`, indexed by seq % FP_WINDOW, for a caller
        that records deliveries itself (the C receive loop writes `fingerprint` into them)."""
        if self._fp is None:
            self._fp_seq = array("q", [-1]) * FP_WINDOW
            self._fp = array("q", [0]) * FP_WINDOW
        return self._fp_seq, self._fp  # type: ignore[return-value]

    def stale_copy(self, seq: int, payload: bytes) -> bool:
        """True when a live `seq` that would read as a RESTART is a copy of the payload already
        delivered at that seq (duplicated or reordered on the way): drop it, nothing restarted."""
        fp = self._fp
        if fp is None or self.classify_live(seq).action is not Action.RESTART:
            return False
        i = seq % FP_WINDOW
        return self._fp_seq[i] == _ring_seq(seq) and fp[i] == fingerprint(payload)  # type: ignore[index]

    @property
    def expected(self) -> int:
        return 0 if self.last is None else self.last + 1

    def classify_live(self, seq: int) -> Verdict:
        """Verdict for a live seq. Pure: does not change the state (see `accept_live`)."""
        if self.live_last is not None:
            if seq <= self.live_last:
                return _RESTART
        elif self.last is not None and seq <= self.last:
            return _RESTART
        if self.last is not None and seq <= self.last:
            return _DUPLICATE
        expected = self.expected
        if seq == expected:
            return _APPLY
        return Verdict(Action.GAP, expected, seq - 1)

    def take_next(self, seq: int) -> bool:
        """The hot path: if `seq` is the in-order successor on a caught-up live stream (nothing
        replayed ahead of it, so `on_live` would deliver exactly it and nothing else), record it
        and return True. Otherwise touch nothing and return False: the caller runs `on_live`."""
        last = self.last
        if last is not None and seq == last + 1 and self.live_last == last:
            self.last = self.live_last = seq
            return True
        return False

    def restart(self) -> None:
        """The publisher started over: forget everything (the consumer clears the worker)."""
        self.last = None
        self.live_last = None
        self._fp_seq = self._fp = None

    def seen_live(self, seq: int) -> None:
        self.live_last = seq

    def delivered(self, seq: int) -> None:
        self.last = seq


class GapResolution(Generic[T]):
    """Outcome of filling one gap from a replay.

    `deliver` are the replayed items to hand downstream, in seq order, all inside the gap.
    `recovered` is True when they cover the whole gap. `extra`/`duplicates` count replayed items
    outside the gap (left to the live stream) or repeated.
    """

    __slots__ = ("first", "last", "recovered", "deliver", "extra", "duplicates")

    def __init__(self, first: int, last: int, recovered: bool, deliver: list[tuple[int, T]],
                 extra: int, duplicates: int) -> None:
        self.first = first
        self.last = last
        self.recovered = recovered
        self.deliver = deliver
        self.extra = extra
        self.duplicates = duplicates


def resolve_gap(first: int, last: int, replayed: Iterable[tuple[int, T]]) -> GapResolution[T]:
    """Pick, from replayed `(seq, item)` pairs (any order, possibly duplicated or partial), the ones
    that fill the gap [first, last], in order. Recovered iff every seq in the range is present."""
    if last < first:
        raise ValueError(f"empty gap {first}..{last}")
    chosen: dict[int, T] = {}
    extra = duplicates = 0
    for seq, item in replayed:
        if seq < first or seq > last:
            extra += 1
        elif seq in chosen:
            duplicates += 1
        else:
            chosen[seq] = item
    deliver = [(s, chosen[s]) for s in sorted(chosen)]
    recovered = len(deliver) == last - first + 1
    return GapResolution(first, last, recovered, deliver, extra, duplicates)


def missing_ranges(first: int, last: int, present: Sequence[int]) -> list[tuple[int, int]]:
    """Sub-ranges of [first, last] absent from the sorted `present` seqs (for logging holes)."""
    out: list[tuple[int, int]] = []
    cursor = first
    for s in present:
        if s < cursor or s > last:
            continue
        if s > cursor:
            out.append((cursor, s - 1))
        cursor = s + 1
    if cursor <= last:
        out.append((cursor, last))
    return out


# --- the whole per-message procedure, with the replay fetch injected ------------------------------

class RestartStep:
    __slots__ = ("old_seq", "new_seq")

    def __init__(self, old_seq: int, new_seq: int) -> None:
        self.old_seq = old_seq
        self.new_seq = new_seq


class GapStep:
    __slots__ = ("resolution",)

    def __init__(self, resolution: GapResolution) -> None:
        self.resolution = resolution


class DeliverStep(Generic[T]):
    __slots__ = ("seq", "item", "replayed")

    def __init__(self, seq: int, item: T, replayed: bool) -> None:
        self.seq = seq
        self.item = item
        self.replayed = replayed


Step = Union[RestartStep, GapStep, DeliverStep]


def on_live(tracker: SeqTracker, seq: int, item: T,
            fetch_replay: Callable[[int, int], Iterable[tuple[int, T]]]) -> list[Step]:
    """Process one live message: returns, in order, what the consumer must see.

    `fetch_replay(first, last)` returns replayed `(seq, item)` pairs (it may return more, fewer,
    or none — e.g. on timeout); it is only called for a gap, or after a restart verdict. A gap's
    `GapStep` precedes the replayed items, so a consumer told `recovered=False` clears the worker
    *before* applying them.

    Catch-up after a restart verdict: a seq at/below what the live stream already passed is either
    a restarted publisher or a stale copy (duplicated or reordered on the way). Seq alone cannot
    tell them apart, so both are treated as a restart (clear, rebuild from the replay) — but the
    seqs the live stream had passed will never come live again, so the rebuild also takes the
    replay's contiguous run after `seq` up to that point. For a stale copy that restores them;
    for a real restart the run is the new publisher's own later batches, whose queued live copies
    then arrive as duplicates (docs/service.md, "Replays").
    """
    steps: list[Step] = []
    verdict = tracker.classify_live(seq)
    passed = -1  # after a restart verdict: the highest seq delivered or seen live before it
    if verdict.action is Action.RESTART:
        old = tracker.last if tracker.last is not None else (tracker.live_last if tracker.live_last is not None else -1)
        passed = max(-1 if tracker.last is None else tracker.last,
                     -1 if tracker.live_last is None else tracker.live_last)
        steps.append(RestartStep(old, seq))
        tracker.restart()
        verdict = tracker.classify_live(seq)
    tracker.seen_live(seq)
    if verdict.action is Action.DUPLICATE:
        return steps
    gap = verdict.action is Action.GAP
    if gap or passed > seq:
        first = verdict.first if gap else seq + 1
        replayed = list(fetch_replay(first, max(verdict.last, passed)))
        if gap:
            res = resolve_gap(verdict.first, verdict.last, replayed)
            steps.append(GapStep(res))
            for s, it in res.deliver:
                steps.append(DeliverStep(s, it, True))
    steps.append(DeliverStep(seq, item, False))
    last = seq
    if passed > seq:
        after = {s: it for s, it in replayed if seq < s <= passed}
        while last + 1 in after:
            last += 1
            steps.append(DeliverStep(last, after[last], True))
    tracker.delivered(last)
    return steps
