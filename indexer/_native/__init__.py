"""The C accelerator of the index core (docs/index-core.md).

`KVATLAS_NATIVE_PATH` names another build of the same source (the ASan + UBSan build of
`make test-sanitize`); it then replaces the in-tree `_kvnative` for the whole process, whoever imports it.
`KVATLAS_ZMQDRAIN_PATH` does the same for the subscriber's receive loop `_zmqdrain`.
"""
from __future__ import annotations

import importlib.util
import os
import sys

ENV_NATIVE_PATH = "KVATLAS_NATIVE_PATH"
ENV_ZMQDRAIN_PATH = "KVATLAS_ZMQDRAIN_PATH"


def _load_override(path: str, module: str = "_kvnative", env: str = ENV_NATIVE_PATH) -> object:
    name = __name__ + "." + module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{env}={path!r} is not an extension module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[name] = mod
    return mod


if os.environ.get(ENV_NATIVE_PATH):
    _kvnative = _load_override(os.environ[ENV_NATIVE_PATH])
if os.environ.get(ENV_ZMQDRAIN_PATH):
    _zmqdrain = _load_override(os.environ[ENV_ZMQDRAIN_PATH], "_zmqdrain", ENV_ZMQDRAIN_PATH)
