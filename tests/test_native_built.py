"""`make test` / CI fail when the C accelerator that `pip install -e .` should build is missing or stale
(a silent ~9x slower index otherwise). Set KVATLAS_ALLOW_PURE_PYTHON=1 to accept the pure-Python core
on a machine without a compiler (docs/index-core.md)."""
from __future__ import annotations

import os

from indexer.core import native as native_core
from indexer.index import KVIndex

ENV_ALLOW = "KVATLAS_ALLOW_PURE_PYTHON"


def test_native_accelerator_is_built() -> None:
    if os.environ.get(ENV_ALLOW, "") not in ("", "0"):
        return  # explicitly accepted: the pure core serves (same results, slower)
    assert native_core.available(), (
        f"the C accelerator is not usable ({native_core.unavailable_reason()}); rebuild with "
        f"`pip install -e .` (needs a C compiler and Python headers) or set {ENV_ALLOW}=1"
    )
    assert KVIndex(native=None).native or os.environ.get(native_core.ENV_PURE, "") not in ("", "0")


def test_c_receive_loop_is_built() -> None:
    """The subscriber's C receive loop (indexer/_native/zmqdrain.c): without it ingestion runs
    through pyzmq frame by frame (same deliveries, ~2x the ingest thread's time per batch)."""
    from indexer import zmqdrain

    if os.environ.get(ENV_ALLOW, "") not in ("", "0") or os.environ.get(zmqdrain.ENV_PURE, "") not in ("", "0"):
        return
    assert zmqdrain.recv_run is not None, (
        f"the C receive loop is not usable ({zmqdrain.unavailable_reason}); rebuild with `pip install -e .` "
        f"or set {ENV_ALLOW}=1")


def test_builds_carry_the_digest_of_the_sources_beside_them() -> None:
    """setup.py compiles each accelerator with the digest of its sources; the loaders compare it with
    the files now on disk, so a pull without a rebuild is refused, not run with an old calling convention."""
    from cbuild.tables import KVNATIVE_FILES, PAGEHASH_FILES, source_digest, stale_build

    if os.environ.get(ENV_ALLOW, "") not in ("", "0"):
        return
    from indexer._native import _kvnative
    from producer._native import _pagehash

    assert _kvnative.SOURCE_DIGEST == source_digest(KVNATIVE_FILES)
    assert _pagehash.SOURCE_DIGEST == source_digest(PAGEHASH_FILES)
    assert stale_build(_kvnative.SOURCE_DIGEST, KVNATIVE_FILES) is None
    assert "stale build" in (stale_build("0" * 64, KVNATIVE_FILES) or "")
    assert stale_build(None, KVNATIVE_FILES) is None  # the sanitizer build carries none: not judged
    assert source_digest(("no/such/file.c",)) is None  # an install without sources: not judged


def test_the_digest_covers_every_included_part(tmp_path) -> None:
    from cbuild.tables import KVNATIVE_FILES, ROOT, source_digest

    for name in KVNATIVE_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    before = source_digest(KVNATIVE_FILES, tmp_path)
    assert before == source_digest(KVNATIVE_FILES)
    part = tmp_path / KVNATIVE_FILES[3]
    part.write_bytes(part.read_bytes() + b"/* changed */\n")
    assert source_digest(KVNATIVE_FILES, tmp_path) != before


def test_the_file_lists_name_every_c_source() -> None:
    """A new C part missing from cbuild/tables.py would neither be watched by the digest nor by
    setup.py's `depends`."""
    from cbuild.tables import KVNATIVE_FILES, PAGEHASH_FILES, ROOT

    index_c = {str(p.relative_to(ROOT)) for p in (ROOT / "indexer/_native").glob("*.[ch]")}
    assert index_c - {"indexer/_native/zmqdrain.c"} == set(KVNATIVE_FILES)
    producer_c = {str(p.relative_to(ROOT)) for p in (ROOT / "producer/_native").rglob("*.[ch]")}
    assert producer_c == set(PAGEHASH_FILES)


def test_the_walks_prefetches_are_compiled_in() -> None:
    """`pf_slot` is always_inline: out of line, GCC judged it pure and deleted every call, and no build
    had a prefetch instruction (docs/index-core.md, score_rows). Read with objdump where there is one."""
    import shutil
    import subprocess

    import pytest

    if os.environ.get(ENV_ALLOW, "") not in ("", "0"):
        return
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump on this machine")
    from indexer._native import _kvnative

    asm = subprocess.run([objdump, "-d", _kvnative.__file__], capture_output=True, text=True, check=True).stdout
    if "x86-64" not in subprocess.run([objdump, "-f", _kvnative.__file__], capture_output=True, text=True).stdout:
        pytest.skip("prefetch opcode checked on x86-64 only")
    assert asm.count("prefetcht0") >= 8  # the walks', the applies', tier_counts' and restore's
