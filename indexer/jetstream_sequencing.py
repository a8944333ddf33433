"""Per-worker position in a JetStream events stream: the pure decision core of the JetStream
subscriber (docs/jetstream.md). No I/O, no clocks.

The watermark of a JetStream worker is the **stream sequence** of the last message applied: it is
unique, never reused and the same for every replica, so `add(last_seq=W)` resumes exactly at W+1.
The publisher's own `(epoch, seq)` headers tell what happened between two messages:

- same epoch, seq = previous + 1       -> apply
- same epoch, seq <= previous          -> duplicate (outside the dedup window): skip
- same epoch, seq >  previous + 1      -> lost before JetStream stored it: Gap(recovered=False)
- new epoch                            -> the publisher restarted: Restart; and if its seq is not
                                          0, its first batches are gone too: Gap(recovered=False)
- predecessor unknown (fresh worker, or the watermark's own message was trimmed):
    fresh, seq 0 -> apply; fresh, seq > 0 -> Gap(recovered=False) (its start was trimmed)
    resumed, retention may have removed messages after W -> seq 0: Restart, else Gap(recovered=False)
    resumed, nothing after W removed -> seq 0: Restart, else apply (continuation)
"""
from __future__ import annotations

import enum


class StepKind(enum.Enum):
    GAP = "gap"  # (first, last) in stream sequence terms; always unrecovered
    RESTART = "restart"  # (old, new) stream sequences


class Step:
    __slots__ = ("kind", "a", "b")

    def __init__(self, kind: StepKind, a: int, b: int) -> None:
        self.kind = kind
        self.a = a
        self.b = b

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Step) and (self.kind, self.a, self.b) == (other.kind, other.a, other.b)

    def __repr__(self) -> str:
        return f"Step({self.kind.name}, {self.a}, {self.b})"


class StreamCursor:
    """One worker's position: `last` stream seq applied, and the publisher epoch/seq it carried."""

    __slots__ = ("last", "epoch", "pubseq", "maybe_trimmed", "duplicates", "resumed")

    def __init__(self, last: int | None = None, *, epoch: str | None = None, pubseq: int | None = None,
                 maybe_trimmed: bool = False) -> None:
        if last is not None and last < 0:
            raise ValueError(f"watermark must be >= 0 or None, got {last}")
        self.last = last
        self.epoch = epoch if last is not None else None
        self.pubseq = pubseq if epoch is not None else None
        self.maybe_trimmed = maybe_trimmed
        self.duplicates = 0
        self.resumed = last is not None  # started from a watermark (vs. from the stream's start)

    def take(self, sseq: int, epoch: str, pubseq: int) -> list[Step] | None:
        """Steps to announce before applying the message at stream seq `sseq`, or None when the
        message must be skipped (a duplicate or a stream position already applied)."""
        last = self.last
        if last is not None and sseq <= last:
            return None  # an ordered consumer never goes back; guard anyway
        steps: list[Step] = []
        gap_first = 0 if last is None else last + 1
        if self.epoch is None:
            if not self.resumed:
                if pubseq != 0:
                    steps.append(Step(StepKind.GAP, gap_first, sseq - 1))
            elif pubseq == 0:
                steps.append(Step(StepKind.RESTART, -1 if last is None else last, sseq))
            elif self.maybe_trimmed:
                steps.append(Step(StepKind.GAP, gap_first, sseq - 1))
        elif epoch != self.epoch:
            steps.append(Step(StepKind.RESTART, -1 if last is None else last, sseq))
            if pubseq != 0:
                steps.append(Step(StepKind.GAP, gap_first, sseq - 1))
        else:
            prev = self.pubseq if self.pubseq is not None else -1
            if pubseq <= prev:
                self.duplicates += 1
                self.last = sseq  # consumed: a resume must not read it again
                return None
            if pubseq != prev + 1:
                steps.append(Step(StepKind.GAP, gap_first, sseq - 1))
        self.last = sseq
        self.epoch = epoch
        self.pubseq = pubseq
        self.maybe_trimmed = False
        return steps

    def skip(self, sseq: int) -> None:
        """A message that is not ours (bad headers) was consumed at `sseq`."""
        if self.last is None or sseq > self.last:
            self.last = sseq
