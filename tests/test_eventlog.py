"""Event log format (design §7): exact payload bytes, streaming read, truncated tails, corruption."""
from __future__ import annotations

import struct
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.eventlog import MAGIC, EventLogError, EventLogWriter, LogFrame, read_event_log


def write_frames(path: Path, frames: list[tuple]) -> None:
    with EventLogWriter(path) as w:
        for f in frames:
            w.write(*f)


FRAMES = [
    (1.5, "w0", 0, 0, b"\x93\xcb" + b"\x00" * 8 + b"\x90\x00"),
    (1.75, "w1", None, 7, b""),
    (2.0, "w0", 3, 1, bytes(range(256)) * 40),  # payload bytes kept exactly, any content
]


def test_write_read_round_trip_and_exact_layout(tmp_path: Path) -> None:
    p = tmp_path / "a.kvlog"
    write_frames(p, FRAMES)
    raw = p.read_bytes()
    assert raw.startswith(MAGIC)
    # First frame by hand: u32 BE length, then msgpack [recv_ts, worker, dp_rank, seq, payload].
    (n,) = struct.unpack(">I", raw[8:12])
    assert msgspec.msgpack.decode(raw[12:12 + n]) == [1.5, "w0", 0, 0, FRAMES[0][4]]
    reader = read_event_log(p)
    assert next(reader) == LogFrame(*FRAMES[0])  # an iterator, consumable piecemeal
    got = [LogFrame(*FRAMES[0]), *reader]
    assert got == [LogFrame(*f) for f in FRAMES]
    assert not reader.truncated and reader.frames == 3 and reader.corrupt_frames == 0


@pytest.mark.parametrize("cut", [1, 3, 4, 5, 100])
def test_truncated_last_frame_ends_stream_without_exception(tmp_path: Path, cut: int) -> None:
    p = tmp_path / "t.kvlog"
    write_frames(p, FRAMES)
    data = p.read_bytes()
    p.write_bytes(data[:-cut])
    reader = read_event_log(p)
    got = list(reader)
    assert got == [LogFrame(*f) for f in FRAMES[:2]]
    assert reader.truncated


def test_empty_log_and_bad_magic(tmp_path: Path) -> None:
    p = tmp_path / "e.kvlog"
    write_frames(p, [])
    reader = read_event_log(p)
    assert list(reader) == [] and not reader.truncated
    bad = tmp_path / "bad.kvlog"
    bad.write_bytes(b"NOTALOG!" + b"\x00" * 10)
    with pytest.raises(EventLogError, match="not a kvatlas event log"):
        read_event_log(bad)
    with pytest.raises(EventLogError, match="cannot open"):
        read_event_log(tmp_path / "missing.kvlog")


def test_corrupt_complete_frame_is_skipped_and_counted(tmp_path: Path) -> None:
    p = tmp_path / "c.kvlog"
    good = msgspec.msgpack.encode([1.0, "w", None, 0, b"x"])
    bad = msgspec.msgpack.encode(["not-a-ts", 5])
    p.write_bytes(MAGIC + b"".join(struct.pack(">I", len(b)) + b for b in (good, bad, good)))
    reader = read_event_log(p)
    assert len(list(reader)) == 2 and reader.corrupt_frames == 1 and not reader.truncated


def test_implausible_length_is_treated_as_truncation(tmp_path: Path) -> None:
    p = tmp_path / "l.kvlog"
    good = msgspec.msgpack.encode([1.0, "w", None, 0, b"x"])
    p.write_bytes(MAGIC + struct.pack(">I", len(good)) + good + b"\xff\xff\xff\xff" + b"junk")
    reader = read_event_log(p)
    assert len(list(reader)) == 1 and reader.truncated


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    with EventLogWriter(tmp_path / "w.kvlog") as w:
        with pytest.raises(ValueError):
            w.write(0.0, "w", None, -1, b"")
        with pytest.raises(TypeError):
            w.write(0.0, 5, None, 0, b"")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="closed"):
        w.write(0.0, "w", None, 0, b"")


def test_reader_streams_large_logs(tmp_path: Path) -> None:
    p = tmp_path / "big.kvlog"
    payload = b"p" * 1000
    with EventLogWriter(p) as w:
        for i in range(20_000):
            w.write(float(i), f"w{i % 4}", i % 2, i // 4, payload)
    n = 0
    for i, fr in enumerate(read_event_log(p)):
        assert fr.seq == i // 4 and fr.worker == f"w{i % 4}" and fr.payload == payload
        n += 1
    assert n == 20_000


frame_st = st.tuples(st.floats(allow_nan=False), st.text(max_size=10), st.one_of(st.none(), st.integers(0, 1000)),
                     st.integers(0, (1 << 64) - 1), st.binary(max_size=300))


@settings(max_examples=60, deadline=None)
@given(st.lists(frame_st, max_size=8), st.integers(0, 400))
def test_any_prefix_of_a_log_reads_a_prefix_of_its_frames(frames: list[tuple], cut: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "h.kvlog"
        write_frames(p, frames)
        data = p.read_bytes()
        length = max(len(MAGIC), len(data) - cut)
        p.write_bytes(data[:length])
        reader = read_event_log(p)
        got = list(reader)
    # Expected: every frame that fits completely; truncated iff bytes of a partial frame remain.
    end, complete = len(MAGIC), 0
    for f in frames:
        size = 4 + len(msgspec.msgpack.encode(LogFrame(*f)))
        if end + size > length:
            break
        end += size
        complete += 1
    assert got == [LogFrame(*f) for f in frames[:complete]]
    assert reader.truncated == (end < length)
