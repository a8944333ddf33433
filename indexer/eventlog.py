"""Recorded event logs (design §7): `b"KVATLOG1"`, then frames of u32 big-endian length + msgpack
`[recv_ts, worker, dp_rank, seq, payload]`. The payload is kept exactly as received, so a log can be
re-published byte for byte or applied offline.

The reader streams, and a truncated last frame (a recorder killed mid-write) ends the stream with
`reader.truncated = True` and a warning — never an exception. A complete frame whose content does
not decode is skipped and counted (`reader.corrupt_frames`); the length prefix lets us resync.
"""
from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterator
from typing import BinaryIO

import msgspec

log = logging.getLogger(__name__)

MAGIC = b"KVATLOG1"
MAX_FRAME = 256 * 1024 * 1024  # a length beyond this is corruption, not a frame
_LEN = struct.Struct(">I")


class LogFrame(msgspec.Struct, array_like=True, frozen=True):
    recv_ts: float
    worker: str
    dp_rank: int | None
    seq: int
    payload: bytes


class EventLogError(ValueError):
    """The file is not an event log (bad magic) or cannot be opened."""


class EventLogWriter:
    """Appends frames to a new log file. Not thread-safe: one recorder owns it."""

    __slots__ = ("path", "_f", "_encoder", "frames", "bytes_written")

    def __init__(self, path: str | os.PathLike[str], buffer_size: int = 1 << 20) -> None:
        self.path = os.fspath(path)
        self._f: BinaryIO | None = open(self.path, "wb", buffering=buffer_size)  # noqa: SIM115
        self._encoder = msgspec.msgpack.Encoder()
        self._f.write(MAGIC)
        self.frames = 0
        self.bytes_written = len(MAGIC)

    def write(self, recv_ts: float, worker: str, dp_rank: int | None, seq: int,
              payload: bytes | bytearray | memoryview) -> None:
        if self._f is None:
            raise ValueError("event log writer is closed")
        if not isinstance(worker, str):
            raise TypeError(f"worker must be str, got {type(worker).__name__}")
        if not 0 <= seq < (1 << 64):
            raise ValueError(f"seq {seq} outside u64")
        body = self._encoder.encode(LogFrame(float(recv_ts), worker, dp_rank, seq, bytes(payload)))
        if len(body) > MAX_FRAME:
            raise ValueError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
        # One write per frame so a crash leaves at most one partial frame, at the end.
        self._f.write(_LEN.pack(len(body)) + body)
        self.frames += 1
        self.bytes_written += 4 + len(body)

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.flush()
            self._f.close()
            self._f = None

    def __enter__(self) -> EventLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventLogReader:
    """Iterates the frames of a log, streaming. Single pass."""

    __slots__ = ("path", "truncated", "corrupt_frames", "frames", "_f", "_decoder", "_gen")

    def __init__(self, path: str | os.PathLike[str], buffer_size: int = 1 << 20) -> None:
        self.path = os.fspath(path)
        self.truncated = False
        self.corrupt_frames = 0
        self.frames = 0
        self._decoder = msgspec.msgpack.Decoder(LogFrame)
        self._gen: Iterator[LogFrame] | None = None
        try:
            self._f: BinaryIO | None = open(self.path, "rb", buffering=buffer_size)  # noqa: SIM115
        except OSError as exc:
            raise EventLogError(f"cannot open event log {self.path}: {exc}") from exc
        magic = self._f.read(len(MAGIC))
        if magic != MAGIC:
            self._f.close()
            self._f = None
            raise EventLogError(f"{self.path} is not a kvatlas event log (magic {magic[:8]!r}, "
                                f"expected {MAGIC!r})")

    def __iter__(self) -> Iterator[LogFrame]:
        return self

    def __next__(self) -> LogFrame:
        if self._gen is None:
            self._gen = self._frames()
        return next(self._gen)

    def _frames(self) -> Iterator[LogFrame]:
        f = self._f
        if f is None:
            return
        try:
            while True:
                head = f.read(4)
                if not head:
                    return
                if len(head) < 4:
                    self._truncate("length prefix")
                    return
                (n,) = _LEN.unpack(head)
                if n > MAX_FRAME:
                    self._truncate(f"implausible frame length {n}")
                    return
                body = f.read(n)
                if len(body) < n:
                    self._truncate(f"frame body ({len(body)} of {n} bytes)")
                    return
                try:
                    frame = self._decoder.decode(body)
                except msgspec.MsgspecError as exc:
                    self.corrupt_frames += 1
                    log.warning("%s: frame %d is corrupt, skipped: %s", self.path, self.frames, exc)
                    continue
                self.frames += 1
                yield frame
        finally:
            self.close()

    def _truncate(self, what: str) -> None:
        self.truncated = True
        log.warning("%s: truncated %s after %d frames; stopping there", self.path, what, self.frames)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> EventLogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_event_log(path: str | os.PathLike[str]) -> EventLogReader:
    """Open a log for streaming: `for frame in (r := read_event_log(p)): ...; r.truncated`.
    Raises `EventLogError` at once when the file is not an event log."""
    return EventLogReader(path)
