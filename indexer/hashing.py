"""Content hashing for the index: one function for stores and queries.

Every full block of `block_size` tokens gets a 64-bit *block digest* `b` from its own token ids
(and, when present, its vLLM `extra_keys`). Blocks are then chained by tree position with a
polynomial rolling state over Z/2^64:

    s_0 = namespace seed (from model block size, lora_name, cache_salt)
    s_i = s_{i-1} * P + b_i            (mod 2^64)

`s_i` is the node key. Because the recurrence is linear in the digests, a whole run of blocks is
chained in one vectorised step (`s_i = P^i * (s_0 + sum_j b_j * P^-j)`), so a 32k-token query or
every new block of an event batch costs a handful of numpy calls rather than a Python loop. The
non-linearity lives in the per-block digest (multiply/xor-shift mixing of each token, then a
finaliser), so distinct blocks give independent-looking digests. This is a routing hash, not a
cryptographic one: a collision costs a mis-scored block, never wrong KV, because engines verify
their own hashes.

`chain_keys_py` is the scalar pure-Python twin; the C accelerator (`indexer/_native/hashing.c`)
implements the same digest and chain; tests check all of them agree bit for bit.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

MASK64 = (1 << 64) - 1
_P = 0x9E3779B97F4A7C15  # odd, so invertible mod 2^64
CHAIN_P = _P  # the chain multiplier, for hot loops that inline `step_py`
_PINV = pow(_P, -1, 1 << 64)
_K1 = 0xBF58476D1CE4E5B9
_K2 = 0x94D049BB133111EB
_K3 = 0xD6E8FEB86659FD93
_EXTRA_SALT = 0xA0761D6478BD642F

_U64 = np.uint64
_K1_np, _K2_np, _K3_np = _U64(_K1), _U64(_K2), _U64(_K3)
_S29, _S31, _S32 = _U64(29), _U64(31), _U64(32)


def _column_consts(n: int) -> np.ndarray:
    # Distinct odd constant per token position so that permuting tokens changes the digest.
    return np.array([(((i + 1) * _K3) ^ (i * _P)) & MASK64 | 1 for i in range(n)], dtype=np.uint64)


class _Powers:
    """Grow-only tables of P^i and P^-i (mod 2^64); plain cache, deterministic content."""

    __slots__ = ("pow", "inv")

    def __init__(self) -> None:
        self.pow = np.ones(1, dtype=np.uint64)
        self.inv = np.ones(1, dtype=np.uint64)

    def ensure(self, n: int) -> None:
        have = len(self.pow)
        if n < have:
            return
        size = max(n + 1, have * 2)
        p = [1] * size
        q = [1] * size
        for i in range(1, size):
            p[i] = (p[i - 1] * _P) & MASK64
            q[i] = (q[i - 1] * _PINV) & MASK64
        self.pow = np.array(p, dtype=np.uint64)
        self.inv = np.array(q, dtype=np.uint64)


_POW = _Powers()
_COLS: dict[int, np.ndarray] = {}


def namespace_seed(block_size: int, lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """Chain start for one namespace; LoRA and cache salt never share blocks with the base model."""
    raw = msgspec.msgpack.encode([block_size, lora_name, cache_salt])
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") | 1


def extra_digest(extra: Any) -> int:
    """64-bit digest of one block's extra keys (multimodal ids, salts). 0 means none."""
    if extra is None:
        return 0
    try:
        raw = msgspec.msgpack.encode(extra)
    except (TypeError, msgspec.EncodeError):
        raw = repr(extra).encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") | 1


def _mix_scalar(x: int) -> int:
    x ^= x >> 29
    x = (x * _K3) & MASK64
    x ^= x >> 32
    return x


def block_digests(tokens: np.ndarray, extras: Sequence[int] | None = None) -> np.ndarray:
    """Digest of each row of a (blocks x block_size) token matrix; uint64 per block."""
    n, bs = tokens.shape
    cols = _COLS.get(bs)
    if cols is None:
        cols = _COLS[bs] = _column_consts(bs)
    x = tokens.astype(np.uint64, copy=False) * _K1_np
    x += cols
    x ^= x >> _S31
    x *= _K2_np
    b = x.sum(axis=1, dtype=np.uint64)
    if extras is not None:
        ex = np.asarray(extras, dtype=np.uint64)
        if ex.any():
            b ^= ex * _U64(_EXTRA_SALT)
    b ^= b >> _S29
    b *= _K3_np
    b ^= b >> _S32
    return b


def block_digest_py(tokens: Sequence[int], extra: int = 0) -> int:
    """Scalar twin of `block_digests` for one block (reference and tests)."""
    bs = len(tokens)
    cols = _COLS.get(bs)
    if cols is None:
        cols = _COLS[bs] = _column_consts(bs)
    acc = 0
    for t, c in zip(tokens, cols.tolist()):
        x = (((t & MASK64) * _K1) + c) & MASK64
        x ^= x >> 31
        acc = (acc + x * _K2) & MASK64
    if extra:
        acc ^= (extra * _EXTRA_SALT) & MASK64
    return _mix_scalar(acc)


def chain(starts: np.ndarray, digests: np.ndarray, seg_pos: np.ndarray, seg_start_idx: np.ndarray) -> np.ndarray:
    """Chain many runs at once.

    `digests[k]` belongs to run `r` at 1-based position `seg_pos[k]`; `starts[r]` is the run's
    parent state and `seg_start_idx[k]` the index of the run's first digest. Returns s for each k.
    """
    n = len(digests)
    if n == 0:
        return np.empty(0, dtype=np.uint64)
    _POW.ensure(int(seg_pos.max()))
    t = digests * _POW.inv[seg_pos]
    c = np.cumsum(t, dtype=np.uint64)
    # Subtract what the cumulative sum held before each run began (wraps mod 2^64 on purpose).
    base = np.where(seg_start_idx > 0, c[seg_start_idx - 1], _U64(0))
    with np.errstate(over="ignore"):
        return _POW.pow[seg_pos] * (starts + (c - base))


def chain_one(start: int, digests: np.ndarray) -> np.ndarray:
    """Chain one run of digests from `start` (a single prefix: queries, single events)."""
    n = len(digests)
    if n == 0:
        return np.empty(0, dtype=np.uint64)
    _POW.ensure(n)
    t = digests * _POW.inv[1 : n + 1]
    c = np.cumsum(t, dtype=np.uint64)
    c += _U64(start)
    return _POW.pow[1 : n + 1] * c


def tokens_matrix(token_ids: Sequence[int] | np.ndarray, block_size: int) -> np.ndarray:
    """Full blocks of a token sequence as an int64 matrix (trailing partial block dropped)."""
    arr = token_ids if isinstance(token_ids, np.ndarray) else np.asarray(token_ids, dtype=np.int64)
    if arr.dtype != np.int64 and arr.dtype != np.uint64:
        arr = arr.astype(np.int64)
    n = len(arr) // block_size
    return arr[: n * block_size].reshape(n, block_size)


def query_keys(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    seed: int,
    extras: Sequence[int] | None = None,
) -> list[int]:
    """Node keys of every full block of a query, as Python ints (dict lookups want ints)."""
    m = tokens_matrix(token_ids, block_size)
    if len(m) == 0:
        return []
    if extras is not None and len(extras) != len(m):
        extras = list(extras)[: len(m)] + [0] * max(0, len(m) - len(extras))
    return chain_one(seed, block_digests(m, extras)).tolist()


def chain_keys_py(
    token_ids: Sequence[int], block_size: int, seed: int, extras: Sequence[int] | None = None
) -> list[int]:
    """Scalar twin of `query_keys` (pure Python)."""
    out = []
    s = seed
    for i in range(len(token_ids) // block_size):
        b = block_digest_py(token_ids[i * block_size : (i + 1) * block_size], extras[i] if extras else 0)
        s = (s * _P + b) & MASK64
        out.append(s)
    return out


def step_py(state: int, digest: int) -> int:
    """One chain step (scalar)."""
    return (state * _P + digest) & MASK64
