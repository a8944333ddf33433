"""Page hashes: a chain over pages of token ids. Pure functions, no state.

Page i's digest = H(bytes(digest of page i-1) || token ids as u32 little-endian). The event id is the
digest's first 8 bytes read big-endian as a signed int64; the hex digest is the L3 storage key.

- `sha256` (default): SGLang-compatible — the same ids SGLang puts on the wire, so an SGLang
  fleet and ours share L3 keys and an indexer keyed by engine hashes sees the same ids.
- `xxh3`: XXH3-128 instead of SHA-256, ~10x cheaper per page (the SHA-256 chain is nearly all of
  the cost of emitting events). The kvatlas indexer keys blocks by *content*, so it accepts either;
  choose it when no consumer needs SGLang's exact ids. Needs the `xxhash` package.
"""
from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence

import numpy as np

# array('I') is the fastest tokens -> u32 bytes path; only valid where it is 4-byte little-endian.
_FAST_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"


def tokens_to_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as consecutive u32 little-endian (ids outside u32 raise OverflowError)."""
    if _FAST_U32:
        return array.array("I", tokens).tobytes()
    return np.asarray(tokens, dtype="<u4").tobytes()


def page_digest(tokens: Sequence[int], prior: bytes | None) -> bytes:
    """Raw 32-byte digest of one page chained on the previous page's digest (None at the root)."""
    h = hashlib.sha256()
    if prior:
        h.update(prior)
    # One buffer instead of one update per token; the bytes are identical.
    h.update(tokens_to_bytes(tokens))
    return h.digest()


def digest_to_id(digest: bytes) -> int:
    """First 8 bytes as a signed int64: SGLang's event block id."""
    return int.from_bytes(digest[:8], "big", signed=True)


def _chain(tokens: Sequence[int], page_size: int, prior: bytes | None, digest) -> list[bytes]:  # noqa: ANN001
    """Digests for every full page of `tokens` (a partial trailing page is ignored), each page's
    digest = digest(prior digest || page bytes)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    out: list[bytes] = []
    n_full = len(tokens) - len(tokens) % page_size
    if n_full == 0:
        return out
    raw = tokens_to_bytes(tokens[:n_full])
    step = 4 * page_size
    for off in range(0, len(raw), step):
        prior = digest(prior + raw[off:off + step] if prior else raw[off:off + step])
        out.append(prior)
    return out


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def chain_digests(tokens: Sequence[int], page_size: int, prior: bytes | None = None) -> list[bytes]:
    """SHA-256 digests for every full page of `tokens` (SGLang's chain)."""
    return _chain(tokens, page_size, prior, _sha256_digest)


def page_ids(tokens: Sequence[int], page_size: int) -> list[int]:
    """Event ids of every full page of `tokens` from the root."""
    return [digest_to_id(d) for d in chain_digests(tokens, page_size)]


def chain_digests_xxh3(tokens: Sequence[int], page_size: int, prior: bytes | None = None) -> list[bytes]:
    """Like `chain_digests` with XXH3-128 (16-byte digests)."""
    import xxhash  # optional dependency, only for this mode

    return _chain(tokens, page_size, prior, xxhash.xxh3_128_digest)


PAGE_HASHES = {"sha256": chain_digests, "xxh3": chain_digests_xxh3}


def page_hash_chain(name: str):  # noqa: ANN201 - returns one of the chain functions above
    """The chain function for a page-hash name, with a clear error for unknown or unavailable ones."""
    try:
        fn = PAGE_HASHES[name]
    except KeyError:
        raise ValueError(f"unknown page hash {name!r}; choose one of {sorted(PAGE_HASHES)}") from None
    if name == "xxh3":
        try:
            import xxhash  # noqa: F401
        except ImportError:
            raise ValueError("page hash 'xxh3' needs the xxhash package: pip install xxhash") from None
    return fn
