"""SGLang-compatible page hashes: a SHA-256 chain over pages of token ids.

Page i's digest = sha256(bytes(digest of page i-1) || token ids as u32 little-endian). The event id
is the digest's first 8 bytes read big-endian as a signed int64 (what SGLang puts on the wire); the
hex digest is the L3 storage key. Pure functions, no state.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

import numpy as np

_SIGN: Final = 1 << 63
_WRAP: Final = 1 << 64


def page_digest(tokens: Sequence[int], prior: bytes | None) -> bytes:
    """Raw 32-byte digest of one page chained on the previous page's digest (None at the root)."""
    h = hashlib.sha256()
    if prior:
        h.update(prior)
    # One buffer instead of one update per token; the bytes are identical.
    h.update(np.asarray(tokens, dtype="<u4").tobytes())
    return h.digest()


def digest_to_id(digest: bytes) -> int:
    """First 8 bytes as a signed int64: SGLang's event block id."""
    v = int.from_bytes(digest[:8], "big")
    return v - _WRAP if v >= _SIGN else v


def chain_digests(tokens: Sequence[int], page_size: int, prior: bytes | None = None) -> list[bytes]:
    """Digests for every full page of `tokens` (a partial trailing page is ignored)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    out: list[bytes] = []
    n_full = len(tokens) - len(tokens) % page_size
    if n_full == 0:
        return out
    raw = np.asarray(tokens[:n_full], dtype="<u4").tobytes()
    step = 4 * page_size
    sha = hashlib.sha256
    for off in range(0, len(raw), step):
        h = sha(prior) if prior else sha()
        h.update(raw[off:off + step])
        prior = h.digest()
        out.append(prior)
    return out


def page_ids(tokens: Sequence[int], page_size: int) -> list[int]:
    """Event ids of every full page of `tokens` from the root."""
    return [digest_to_id(d) for d in chain_digests(tokens, page_size)]
