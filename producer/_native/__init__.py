"""Optional C helper of the producer (`_pagehash`, built by setup.py from the C files here: docs/producer-events.md).

`KVATLAS_PAGEHASH_PATH` names another build of the same source (the ASan + UBSan build of
`make test-sanitize`); it then replaces the in-tree `_pagehash` for the whole process.
"""
from __future__ import annotations

import importlib.util
import os
import sys

ENV_PAGEHASH_PATH = "KVATLAS_PAGEHASH_PATH"

if os.environ.get(ENV_PAGEHASH_PATH):
    _path = os.environ[ENV_PAGEHASH_PATH]
    _spec = importlib.util.spec_from_file_location(__name__ + "._pagehash", _path)
    if _spec is None or _spec.loader is None:
        raise ImportError(f"{ENV_PAGEHASH_PATH}={_path!r} is not an extension module")
    _pagehash = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_pagehash)
    sys.modules[_spec.name] = _pagehash
