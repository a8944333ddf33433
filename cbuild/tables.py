"""What the two generated C headers share: C string literals of schema names, and the command that
writes or checks a header. Each generator keeps its own tables and layout (indexer/_native/wire.py
→ wire_tables.h, producer/_native/event_tables.py → event_tables.h); this is only their common
plumbing. `header_command` is the only I/O here: it reads (and with `--write` writes) the one header
it is given, and runs only when a developer runs a generator as a command.

It also names the files each C accelerator is compiled from (setup.py builds from these lists) and
their digest: a build carries the digest of the sources it was compiled from, and the loaders refuse
a build whose sources have changed since (a `git pull` without a rebuild), reading the sources only
when they are there (an installed wheel has none).
"""
from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The parts kvnative.c includes (one translation unit, so their functions stay static).
KVNATIVE_PARTS = ("hashing.c", "bodies.c", "u64map.c", "holders.c", "node_maps.c", "score_walk.c", "groups_walk.c", "answer.c",
                  "wire_walk.c", "kv_apply.c", "groups_apply.c", "batch_apply.c")
KVNATIVE_FILES = ("indexer/_native/kvnative.c", *(f"indexer/_native/{f}" for f in KVNATIVE_PARTS),
                  "indexer/_native/u64map.h", "indexer/_native/wire_tables.h")
# The producer helper's C files (also the Makefile's sanitize build: keep the two lists alike).
PAGEHASH_SOURCES = tuple(f"producer/_native/{f}.c" for f in ("module", "chains", "pages", "msgpack", "batch"))
PAGEHASH_FILES = (*PAGEHASH_SOURCES, "producer/_native/pagehash.h", "producer/_native/event_tables.h",
                  "producer/_native/third_party/xxhash.h")


def source_digest(files: Iterable[str], root: Path = ROOT) -> str | None:
    """sha256 over the files' paths and bytes; None when any is absent (an install without sources)."""
    h = hashlib.sha256()
    for name in files:
        try:
            data = (root / name).read_bytes()
        except OSError:
            return None
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def stale_build(built: str | None, files: Iterable[str]) -> str | None:
    """Why a build whose embedded digest is `built` must not be used, or None. A build without a
    digest (the Makefile's sanitizer build) and an install without sources are not judged."""
    now = source_digest(files)
    if built is None or now is None or built == now:
        return None
    return "stale build: its C sources changed since it was compiled (rebuild: make, or pip install -e .)"


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
