"""L3 keys: one per page, the hex of the page's chained hash, plus a suffix per extra pool.

The page hash already chains the whole prefix (design §3), so a key names a page *in context*;
extra pools stored alongside the KV (Mamba state, DSA indexer keys) get `<hex>.<suffix>`.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

_U64 = (1 << 64) - 1
_SUFFIX = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
MAX_KEY_LEN = 1024


def hash_hex(page_hash: int | bytes) -> str:
    """Canonical hex of an engine page hash: ints as 16-digit u64 (signed int64 normalised), bytes verbatim."""
    if isinstance(page_hash, bool):
        raise ValueError("page hash must be int or bytes, got bool")
    if isinstance(page_hash, int):
        return format(page_hash & _U64, "016x")
    if isinstance(page_hash, (bytes, bytearray)):
        if not page_hash:
            raise ValueError("empty page hash")
        return bytes(page_hash).hex()
    raise ValueError(f"page hash must be int or bytes, got {type(page_hash).__name__}")


def page_key(page_hash: int | bytes, suffix: str | None = None) -> str:
    base = hash_hex(page_hash)
    if suffix is None or suffix == "":
        return base
    if not _SUFFIX.match(suffix):
        raise ValueError(f"invalid pool suffix {suffix!r}: use 1-64 chars of [A-Za-z0-9_-]")
    return f"{base}.{suffix}"


def page_keys(page_hashes: Iterable[int | bytes], suffix: str | None = None) -> list[str]:
    return [page_key(h, suffix) for h in page_hashes]


def split_key(key: str) -> tuple[str, str | None]:
    """`<hex>[.<suffix>]` -> (hex, suffix or None)."""
    base, dot, suffix = key.partition(".")
    return base, (suffix if dot else None)
