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
