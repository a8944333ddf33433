"""Page hashes: a chain over pages of token ids. Pure functions, no state.

Page i's digest = H(bytes(digest of page i-1) || token ids as u32 little-endian). The event id is the
digest's first 8 bytes read big-endian as a signed int64; the hex digest is the L3 storage key.

- `sha256` (default): SGLang-compatible — the same ids SGLang puts on the wire, so an SGLang
  fleet and ours share L3 keys and an indexer keyed by engine hashes sees the same ids.
- `xxh3`: XXH3-128 instead of SHA-256 (16-byte digests). The kvatlas indexer keys blocks by
  *content*, so it accepts either; choose it when no consumer needs SGLang's exact ids. Needs the
  `xxhash` package.

One call hashes every whole page of a node (docs/producer-events.md): the optional C helper
`producer._native._pagehash` (SHA-256 on the CPU's SHA unit where present, else OpenSSL's
libcrypto; XXH3-128 from the xxHash library) returns digests and event ids together; without it
(not built, or built from other schemas than these: `event_tables`), or with
KVATLAS_PURE_PYTHON=1, the Python functions below (hashlib, the xxhash package) give identical
results (tests compare both).

`tokens` is a sequence of ints, each within u32 (OverflowError otherwise), or a bytes-like
object of u32 little-endian. A partial trailing page is ignored.
"""
from __future__ import annotations

import array
import functools
import hashlib
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Union

import numpy as np

from cbuild.tables import PAGEHASH_FILES, stale_build

Tokens = Union[Sequence[int], bytes, bytearray, memoryview]
ChainIds = Callable[[Tokens, int, Union[bytes, None]], tuple[list[bytes], list[int]]]
ChainBlob = Callable[[Tokens, int, Union[bytes, None]], bytes]

ENV_PURE = "KVATLAS_PURE_PYTHON"  # the same switch as the index core's (docs/index-core.md)

# array('I') is the fastest tokens -> u32 bytes path; only valid where it is 4-byte little-endian.
_FAST_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"


def _load_native() -> tuple[ModuleType | None, str | None]:
    try:
        from producer._native import _pagehash as mod
    except ImportError as exc:  # not built (no compiler or libssl-dev at install time): hashlib serves
        return None, str(exc)
    from producer._native.event_tables import tables

    if mod.event_tables() != tables():  # built before a schema change: its encoder would be wrong
        return None, "producer._native._pagehash was built from other schemas: reinstall (pip install -e .)"
    stale = stale_build(getattr(mod, "SOURCE_DIGEST", None), PAGEHASH_FILES)
    return (None, stale) if stale else (mod, None)


_native, _NATIVE_ERROR = _load_native()


def native_available() -> bool:
    """Whether the C helper was built (it is used unless KVATLAS_PURE_PYTHON=1)."""
    return _native is not None


def native_unavailable_reason() -> str | None:
    return _NATIVE_ERROR


def _select(native: bool | None) -> ModuleType | None:
    """The C helper to use, or None for pure Python. None: the helper when built, unless
    KVATLAS_PURE_PYTHON=1; True without a build raises; False forces pure Python."""
    if native is False:
        return None
    if native is None and os.environ.get(ENV_PURE, "") not in ("", "0"):
        return None
    if _native is None and native:
        raise RuntimeError(f"native page hashing requested but not available: {_NATIVE_ERROR}")
    return _native


def native_module(native: bool | None = None) -> ModuleType | None:
    """The C helper as `_select` picks it (also serves the event recorder's token packer)."""
    return _select(native)


# Read once: the per-call functions below must not pay an environment lookup per node.
_active = _select(None)


def tokens_to_bytes(tokens: Tokens) -> bytes:
    """Token ids as consecutive u32 little-endian (ids outside u32 raise OverflowError)."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        raw = bytes(tokens)
        if len(raw) % 4:
            raise ValueError("a token buffer must hold u32 values (length a multiple of 4)")
        return raw
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


def _py_chain(tokens: Tokens, page_size: int, prior: bytes | None,
              digest: Callable[[bytes], bytes]) -> tuple[list[bytes], list[int]]:
    """The reference: (digests, ids) for every whole page, digest_i = digest(digest_{i-1} || page_i)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    out: list[bytes] = []
    step = 4 * page_size
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        raw = tokens_to_bytes(tokens)
        raw = raw[:len(raw) - len(raw) % step]
    else:
        n_full = len(tokens) - len(tokens) % page_size
        raw = tokens_to_bytes(tokens[:n_full]) if n_full else b""
    for off in range(0, len(raw), step):
        prior = digest(prior + raw[off:off + step] if prior else raw[off:off + step])
        out.append(prior)
    return out, [int.from_bytes(d[:8], "big", signed=True) for d in out]


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def py_sha256_ids(tokens: Tokens, page_size: int, prior: bytes | None = None) -> tuple[list[bytes], list[int]]:
    """Pure-Python SHA-256 chain (the reference the C helper is tested against)."""
    return _py_chain(tokens, page_size, prior, _sha256_digest)


def py_xxh3_ids(tokens: Tokens, page_size: int, prior: bytes | None = None) -> tuple[list[bytes], list[int]]:
    import xxhash  # optional dependency, only for this mode

    return _py_chain(tokens, page_size, prior, xxhash.xxh3_128_digest)


def sha256_ids(tokens: Tokens, page_size: int, prior: bytes | None = None) -> tuple[list[bytes], list[int]]:
    """SGLang's SHA-256 chain: (digests, event ids) of every whole page, in one call."""
    if _active is None:
        return _py_chain(tokens, page_size, prior, _sha256_digest)
    return _active.sha256_chain(tokens, page_size, prior)


def xxh3_ids(tokens: Tokens, page_size: int, prior: bytes | None = None) -> tuple[list[bytes], list[int]]:
    """Like `sha256_ids` with XXH3-128 (the C helper's own, identical to xxhash's)."""
    if _active is None:
        return py_xxh3_ids(tokens, page_size, prior)
    return _native_xxh3_ids(_active, tokens, page_size, prior)


def _native_xxh3_ids(mod: ModuleType, tokens: Tokens, page_size: int,
                     prior: bytes | None = None) -> tuple[list[bytes], list[int]]:
    blob = mod.xxh3_blob(tokens, page_size, prior)
    return [blob[i:i + 16] for i in range(0, len(blob), 16)], mod.ids_of(blob, 16)


def chain_digests(tokens: Tokens, page_size: int, prior: bytes | None = None) -> list[bytes]:
    """SHA-256 digests for every full page of `tokens` (SGLang's chain)."""
    return sha256_ids(tokens, page_size, prior)[0]


def page_ids(tokens: Tokens, page_size: int) -> list[int]:
    """Event ids of every full page of `tokens` from the root."""
    return sha256_ids(tokens, page_size)[1]


def chain_digests_xxh3(tokens: Tokens, page_size: int, prior: bytes | None = None) -> list[bytes]:
    """Like `chain_digests` with XXH3-128 (16-byte digests)."""
    return xxh3_ids(tokens, page_size, prior)[0]


def _py_ids_of(digests: bytes, dlen: int) -> list[int]:
    if dlen < 8 or len(digests) % dlen:
        raise ValueError("ids_of: digests must be whole digests of at least 8 bytes")
    return [int.from_bytes(digests[i:i + 8], "big", signed=True) for i in range(0, len(digests), dlen)]


def ids_of(digests: bytes, dlen: int) -> list[int]:
    """The event id of every `dlen`-byte digest of a concatenation (a tree node's `digests`)."""
    if _active is None:
        return _py_ids_of(digests, dlen)
    return _active.ids_of(digests, dlen)


def _py_sha256_blob(tokens: Tokens, page_size: int, prior: bytes | None = None) -> bytes:
    return b"".join(_py_chain(tokens, page_size, prior, _sha256_digest)[0])


def _py_xxh3_blob(tokens: Tokens, page_size: int, prior: bytes | None = None) -> bytes:
    return b"".join(py_xxh3_ids(tokens, page_size, prior)[0])


PAGE_HASHES = {"sha256": chain_digests, "xxh3": chain_digests_xxh3}
DIGEST_LEN: dict[str, int] = {"sha256": 32, "xxh3": 16}
PAGE_HASH_IDS: dict[str, ChainIds] = {"sha256": sha256_ids, "xxh3": xxh3_ids}


def _check(name: str) -> None:
    if name not in PAGE_HASHES:
        raise ValueError(f"unknown page hash {name!r}; choose one of {sorted(PAGE_HASHES)}")
    if name == "xxh3":
        try:
            import xxhash  # noqa: F401
        except ImportError:
            raise ValueError("page hash 'xxh3' needs the xxhash package: pip install xxhash") from None


def page_hash_chain(name: str):  # noqa: ANN201 - returns one of the chain functions above
    """The digest-chain function for a page-hash name, with a clear error for unknown or unavailable ones."""
    _check(name)
    return PAGE_HASHES[name]


def page_hash_chain_ids(name: str, native: bool | None = None) -> ChainIds:
    """The (digests, ids) chain function for a page-hash name (what the radix tree calls once per
    node): the C helper's function itself when it serves, so a call has no Python layer.
    `native` as in `_select`."""
    _check(name)
    nat = _select(native)
    if nat is None:
        return functools.partial(_py_chain, digest=_sha256_digest) if name == "sha256" else py_xxh3_ids
    if name == "sha256":
        return nat.sha256_chain
    return functools.partial(_native_xxh3_ids, nat)


def fused_digest(name: str, native: bool | None = None) -> tuple[bool, str | None]:
    """For the event recorder's one-call store of a new node (`Batch.stored_chain`): whether the
    C helper serves `name`, and how it names the page digest (None = its SHA-256, "xxh3" = its
    XXH3-128; both built in, no Python call per page)."""
    _check(name)
    if _select(native) is None:
        return False, None
    return True, (None if name == "sha256" else "xxh3")


def page_hash_chain_blob(name: str, native: bool | None = None) -> ChainBlob:
    """The chain as one bytes object per call (every page's digest, concatenated): what the radix
    tree keeps per node (docs/producer-events.md). `native` as in `_select`."""
    _check(name)
    nat = _select(native)
    if name == "sha256":
        return nat.sha256_blob if nat is not None else _py_sha256_blob
    return nat.xxh3_blob if nat is not None else _py_xxh3_blob
