"""Whether the C accelerator is available, and the switch between it and the pure-Python core.

`indexer._native._kvnative` (built by setup.py; optional at install) is one accelerator of the
pure-Python core, used through `indexer.core.accel` only (docs/index-core.md). The pure core is the
reference and is always available: `KVATLAS_PURE_PYTHON=1` forces it, and `KVIndex(native=False)`
picks it per index. A build whose wire tables differ from `schemas/` (a stale .so) is refused here,
at import, so it can never judge events by old rules; so is one compiled from other C sources than
those beside it (cbuild/tables.py `stale_build`).
"""
from __future__ import annotations

import logging
import os
from types import ModuleType

from cbuild.tables import KVNATIVE_FILES, stale_build

log = logging.getLogger(__name__)

ENV_PURE = "KVATLAS_PURE_PYTHON"


def _load() -> tuple[ModuleType | None, str | None]:
    try:
        from indexer._native import _kvnative as mod
    except ImportError as exc:  # not built (no compiler at install time): the Python core serves
        return None, str(exc)
    from indexer._native.wire import tables

    tabs = getattr(mod, "wire_tables", None)
    if tabs is None or tabs() != tables():
        return None, "stale build: its wire tables differ from schemas/ (rebuild: pip install -e .)"
    stale = stale_build(getattr(mod, "SOURCE_DIGEST", None), KVNATIVE_FILES)
    return (None, stale) if stale else (mod, None)


_mod, _IMPORT_ERROR = _load()


def available() -> bool:
    return _mod is not None


def unavailable_reason() -> str | None:
    """Why the accelerator cannot be used (None when it can)."""
    return _IMPORT_ERROR


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
            raise RuntimeError(f"native index core requested but not available: {_IMPORT_ERROR}")
        log.warning("kvatlas native index core not available (%s); using the pure-Python core (slower)", _IMPORT_ERROR)
        return None
    return _mod


def declines() -> dict[str, int]:
    """Payloads the accelerator's whole-batch walk declined (the pure core judged them) since import,
    per reason (docs/index-core.md, "Every wire shape"); empty without the accelerator."""
    return dict(_mod.declines()) if _mod is not None else {}
