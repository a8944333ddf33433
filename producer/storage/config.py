"""Backend selection and its extra config: inline JSON, or `@path` to a .json/.toml/.yaml file."""
from __future__ import annotations

import json
import os
import sys
from typing import Any

from .base import StorageBackend


def _load_toml(path: str) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        try:
            import tomli as tomllib
        except ImportError as exc:
            raise ValueError(f"cannot read {path}: TOML on Python < 3.11 needs `pip install tomli`") from exc
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"invalid TOML in {path}: {exc}") from exc


def _load_yaml(path: str) -> Any:
    try:
        import yaml
    except ImportError as exc:
        raise ValueError(
            f"cannot read {path}: YAML config needs PyYAML — `pip install pyyaml` (or the kvatlas[yaml] extra)"
        ) from exc
    with open(path, encoding="utf-8") as f:
        try:
            return yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise ValueError(f"invalid YAML in {path}: {exc}") from exc


def _load_json_file(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"invalid JSON in {path}: {exc}") from exc


_LOADERS = {".json": _load_json_file, ".toml": _load_toml, ".yaml": _load_yaml, ".yml": _load_yaml}


def load_backend_config(spec: str | None) -> dict[str, Any]:
    """Parse a backend's extra config.

    `None`/empty -> {}; `@path` -> the file, by extension (.json, .toml, .yaml, .yml); anything
    else -> inline JSON. The result must be a mapping. Every problem is a ValueError that says
    what was wrong.
    """
    if spec is None or not spec.strip():
        return {}
    spec = spec.strip()
    if spec.startswith("@"):
        path = os.path.expanduser(spec[1:])
        if not path:
            raise ValueError("backend config '@' needs a file path after it")
        ext = os.path.splitext(path)[1].lower()
        loader = _LOADERS.get(ext)
        if loader is None:
            raise ValueError(
                f"unsupported backend config file extension {ext or '(none)'!r} for {path}; "
                f"use one of {', '.join(sorted(_LOADERS))}"
            )
        try:
            data = loader(path)
        except FileNotFoundError as exc:
            raise ValueError(f"backend config file not found: {path}") from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read backend config file {path}: {exc}") from exc
        where = path
    else:
        try:
            data = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"backend config is not valid JSON ({exc}); use inline JSON or @file") from exc
        where = "inline JSON"
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"backend config ({where}) must be a mapping/object, got {type(data).__name__}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ValueError(f"backend config ({where}) keys must be strings, got {bad!r}")
    return data


BACKEND_KINDS = ("file", "redis", "memory", "mooncake")


def make_storage_backend(kind: str, config: dict[str, Any] | None = None) -> StorageBackend:
    """Build a backend from its kind and config dict; unknown kinds/options raise ValueError."""
    import inspect

    cfg = dict(config or {})
    k = kind.strip().lower()
    if k == "file":
        from .file_backend import FileStorageBackend as cls
    elif k == "redis":
        from .redis_backend import RedisStorageBackend as cls  # type: ignore[assignment]
    elif k == "mooncake":
        from .mooncake_backend import MooncakeStorageBackend as cls  # type: ignore[assignment]
    elif k == "memory":
        from .memory_backend import MemoryStorageBackend as cls  # type: ignore[assignment]
    else:
        raise ValueError(f"unknown storage backend {kind!r}; expected one of {', '.join(BACKEND_KINDS)}")
    params = inspect.signature(cls).parameters
    unknown = sorted(set(cfg) - set(params))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for the {k} storage backend; accepted: {sorted(params)}")
    required = [n for n, p in params.items() if p.default is inspect.Parameter.empty and p.kind != p.VAR_KEYWORD]
    missing = [n for n in required if n not in cfg]
    if missing:
        raise ValueError(f"the {k} storage backend needs option(s) {missing}")
    try:
        return cls(**cfg)
    except TypeError as exc:
        raise ValueError(f"bad options for the {k} storage backend: {exc}") from exc
