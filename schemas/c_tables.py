"""What the two generated C headers share: C string literals of schema names, and the command that
writes or checks a header. Each generator keeps its own tables and layout (indexer/_native/wire.py
→ wire_tables.h, producer/_native/event_tables.py → event_tables.h); this is only their common
plumbing. `header_command` is the only I/O here: it reads (and with `--write` writes) the one header
it is given, and runs only when a developer runs a generator as a command.
"""
from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path


def c_str(s: str) -> str:
    """`s` as a C string literal; names that would need escaping are refused."""
    assert s.isascii() and '"' not in s and "\\" not in s, s
    return f'"{s}"'


def c_strs(xs: Iterable[str]) -> str:
    """A C initializer list of string literals."""
    return ", ".join(c_str(x) for x in xs)


def header_command(argv: list[str], header: Path, text: str, module: str) -> int:
    """`--write` writes `text` to `header`; either way, exit 1 when the header differs from it."""
    if "--write" in argv:
        header.write_text(text)
    if header.read_text() == text:
        print(f"{header} is current")
        return 0
    print(f"{header} is stale: run python -m {module} --write", file=sys.stderr)
    return 1
