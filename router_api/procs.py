"""Child processes that die with their parent: the one home of that rule for `kvatlas demo`'s
children and the test fixtures (tests/support/).

Three layers, each for a way the parent can end:
- the parent stops normally or on SIGINT (KeyboardInterrupt) / SIGTERM / SIGHUP (`exit_on_signals`
  turns the last two into SystemExit): its `finally` blocks `stop` every child;
- `stop` signals the child's whole process group (a child started with `session=True` leads its
  own), so what the child started itself goes too;
- the parent is killed (SIGKILL, a crash, an OOM kill): Linux sends each child `PDEATHSIG_SIGNAL`
  (prctl PR_SET_PDEATHSIG, set in the child between fork and exec by `die_with_parent`).

PR_SET_PDEATHSIG fires when the *thread* that forked the child ends: spawn long-lived children from
a thread that lives as long as they should (the main thread, a test's thread). Elsewhere than Linux
the last layer is absent (the first two still hold).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = ["PDEATHSIG_SIGNAL", "die_with_parent", "exit_on_signals", "spawn", "stop"]

_PR_SET_PDEATHSIG = 1
# SIGKILL: a child whose parent is gone has nobody to report to; nothing it does on the way out matters.
PDEATHSIG_SIGNAL = signal.SIGKILL


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved in the parent (the child between fork and exec only calls it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return fn


def die_with_parent(sig: int = PDEATHSIG_SIGNAL) -> Callable[[], None] | None:
    """A `preexec_fn` that has the child get `sig` when this process dies (None off Linux)."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl took hold: nobody will signal us
            os.kill(os.getpid(), sig)

    return preexec


def spawn(argv: Sequence[str], *, session: bool = False, **popen: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(argv, **popen)` for a child that dies with this process; `session`: in a
    session (and process group) of its own, so a terminal's Ctrl-C reaches only the parent, which
    stops it (`stop`)."""
    return subprocess.Popen(list(argv), preexec_fn=die_with_parent(), start_new_session=session, **popen)


def stop(proc: subprocess.Popen[Any], grace: float = 5.0) -> int:
    """SIGTERM, then SIGKILL after `grace` seconds; to the child's process group when it leads one
    (`spawn(..., session=True)`), so its own children go too. Returns its exit status."""
    if proc.poll() is None:
        _signal(proc, signal.SIGTERM)
        try:
            return proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    _signal(proc, signal.SIGKILL)  # also what is left of its group
    return proc.wait(10)


def _signal(proc: subprocess.Popen[Any], sig: int) -> None:
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass  # exited (and reaped) in between


@contextmanager
def exit_on_signals(signals: Sequence[int] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """While held (in the main thread), `signals` raise SystemExit(128 + signal) there, so the
    `finally` blocks that stop children run (Python's default for SIGTERM ends the process without
    them; SIGINT already raises KeyboardInterrupt). The old handlers are back on exit."""
    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
