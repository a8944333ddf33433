"""Gap replays of the ZeroMQ subscriber (indexer/subscriber.py): one replay in flight (`Replay`), the
range a live seq makes it ask for (`gap_of`, the pure sequencing core on a probe), and a replay
socket's reply frames in both shapes found in the wild (`parse_replay_reply`)."""
from __future__ import annotations

import zmq

from indexer.sequencing import SeqTracker, on_live
from schemas.frames import END_SEQ, SEQ_BYTES, seq_of


class Replay:
    """One replay in flight: what was asked, what came back, the limits it runs under."""

    __slots__ = ("sock", "seq", "payload", "first", "last", "deadline", "quiet_until", "got", "nbytes")

    def __init__(self, sock: zmq.Socket, seq: int, payload: bytes, first: int, last: int,
                 deadline: float, quiet_until: float) -> None:
        self.sock = sock
        self.seq = seq  # the live message that revealed the gap, delivered after the replay
        self.payload = payload
        self.first = first
        self.last = last
        self.deadline = deadline
        self.quiet_until = quiet_until
        self.got: list[tuple[int, bytes]] = []
        self.nbytes = 0


def parse_replay_reply(frames: list[bytes]) -> tuple[int, bytes] | None | str:
    """One DEALER-side replay reply -> `(seq, payload)`, `None` for the end marker, or a str
    describing why the frames are malformed."""
    if len(frames) == 4 and frames[0] == b"":
        seq_b, payload = frames[2], frames[3]
    elif len(frames) == 3 and frames[0] == b"":
        seq_b, payload = frames[1], frames[2]
    else:
        return f"unexpected replay reply shape ({len(frames)} frames)"
    if seq_b == END_SEQ:
        return None
    if len(seq_b) != SEQ_BYTES:
        return f"replay seq frame of {len(seq_b)} bytes"
    return seq_of(seq_b), payload


def gap_of(tracker: SeqTracker, seq: int) -> tuple[int, int] | None:
    """The range a replay must fill if live `seq` arrived now, else None: the pure core is run on
    a copy of the tracker with a fetch that only records what it was asked for."""
    probe = SeqTracker()
    probe.last, probe.live_last = tracker.last, tracker.live_last
    asked: list[tuple[int, int]] = []
    def fetch(first: int, last: int) -> tuple[()]:
        asked.append((first, last))
        return ()

    on_live(probe, seq, None, fetch)
    return asked[0] if asked else None
