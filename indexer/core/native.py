"""Choice of implementation for the index core's hot loops: the C accelerator or the pure-Python reference.

`indexer._native._kvnative` (built by setup.py; optional) provides faster twins of the hashing
functions, a compact u64 map and the per-block store/remove loops. The pure-Python core is the
reference and is always available: `KVATLAS_PURE_PYTHON=1` forces it, and `KVIndex(native=False)`
picks it per index (the property tests run both and require identical answers).
"""
from __future__ import annotations

import logging
import os
from types import ModuleType

log = logging.getLogger(__name__)

try:
    from indexer._native import _kvnative as _mod
    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # not built (no compiler at install time): the Python core serves
    _mod = None
    _IMPORT_ERROR = str(exc)

ENV_PURE = "KVATLAS_PURE_PYTHON"


def available() -> bool:
    return _mod is not None


def select(native: bool | None) -> ModuleType | None:
    """The accelerator module to use, or None for pure Python.

    native=None: the accelerator when built, unless KVATLAS_PURE_PYTHON=1. native=True without a
    build raises (a caller asking for it explicitly wants to know); False forces pure Python.
    """
    if native is False:
        return None
    if native is None and os.environ.get(ENV_PURE, "") not in ("", "0"):
        return None
    if _mod is None:
        if native:
            raise RuntimeError(f"native index core requested but not built: {_IMPORT_ERROR}")
        log.warning("kvatlas native index core not built (%s); using the pure-Python core (slower)", _IMPORT_ERROR)
        return None
    return _mod
