"""Which processes run, read from /proc (Linux): a process's children, and whether one still runs
(a zombie does not; a pid reused by another process does not count)."""
from __future__ import annotations

import os
from typing import NamedTuple


class Proc(NamedTuple):
    pid: int
    start: int  # start time in clock ticks since boot: tells a reused pid apart


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of `pid`, None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return fields[0], int(fields[1]), int(fields[19])


def children(pid: int) -> set[Proc]:
    """The running children of `pid`."""
    out = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[1] == pid and st[0] != "Z":
                out.add(Proc(int(name), st[2]))
    return out


def descendants(pid: int) -> set[Proc]:
    """Children, their children, and so on."""
    out: set[Proc] = set()
    todo = [pid]
    while todo:
        for c in children(todo.pop()):
            if c not in out:
                out.add(c)
                todo.append(c.pid)
    return out


def running(p: Proc) -> bool:
    st = _stat(p.pid)
    return st is not None and st[0] != "Z" and st[2] == p.start
