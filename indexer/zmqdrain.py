"""The C receive loop of the live subscriber (`indexer/_native/zmqdrain.c`), bound to pyzmq's libzmq.

`recv_run` is None when it cannot be used — not built, libzmq not found in this process, or
`KVATLAS_PURE_PYTHON=1` — and `indexer.subscriber` then receives frame by frame through pyzmq.
Both give the same deliveries (tests/test_zmqdrain.py runs the subscriber tests both ways).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from enum import IntEnum
from typing import Any, NamedTuple

import zmq

from indexer.core.native import ENV_PURE  # the one switch to the pure-Python paths

log = logging.getLogger(__name__)


class OddKind(IntEnum):
    """Why `recv_run` stopped at a message (its C codes)."""

    OTHER_SEQ = 0  # a well-formed message out of the run's order: `value` its seq, `payload` its frame
    FRAME_COUNT = 1  # not two frames: `value` the count
    SEQ_FRAME_SIZE = 2  # a seq frame not 8 bytes: `value` its size


class OddMessage(NamedTuple):
    """The message that ended a run of `recv_run` (its third result, a C tuple made this record)."""

    kind: OddKind
    value: int
    payload: bytes  # the message's payload frame for OTHER_SEQ, else b""


def odd_message(raw: tuple[int, int, bytes | None]) -> OddMessage:
    return OddMessage(OddKind(raw[0]), raw[1], raw[2] or b"")


def loaded_libzmq() -> str | None:
    """The path of the libzmq pyzmq loaded (read from this process's memory map), or None."""
    zmq.zmq_version()  # the backend, hence libzmq, is loaded by now
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if line.count(" ") >= 5 else ""
                if "/libzmq" in path and ".so" in path:
                    return path
    except OSError:
        return None
    return None


def _load() -> tuple[Callable[..., Any] | None, str | None]:
    if os.environ.get(ENV_PURE, "") not in ("", "0"):
        return None, f"{ENV_PURE} is set"
    try:
        from indexer._native import _zmqdrain as loaded
    except ImportError as exc:
        return None, f"not built: {exc}"
    mod: Any = loaded
    path = loaded_libzmq()
    if path is None:
        return None, "pyzmq's libzmq not found in /proc/self/maps"
    try:
        mod.bind(path)
    except OSError as exc:
        return None, str(exc)
    return mod.recv_run, None


recv_run, unavailable_reason = _load()
if recv_run is None:
    log.debug("C receive loop not used (%s): receiving through pyzmq", unavailable_reason)
