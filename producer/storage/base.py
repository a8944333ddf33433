"""The L3 storage backend interface the producer's storage worker drives."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from schemas.media import Medium

# Values may be any bytes-like object so callers can hand over views of host pages without a copy.
BytesLike = bytes | bytearray | memoryview


class StorageCapacity:
    __slots__ = ("used_bytes", "limit_bytes")

    def __init__(self, used_bytes: int, limit_bytes: int | None) -> None:
        self.used_bytes = used_bytes
        self.limit_bytes = limit_bytes

    def __repr__(self) -> str:
        return f"StorageCapacity(used_bytes={self.used_bytes}, limit_bytes={self.limit_bytes})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, StorageCapacity)
            and other.used_bytes == self.used_bytes
            and other.limit_bytes == self.limit_bytes
        )


@runtime_checkable
class StorageBackend(Protocol):
    """Synchronous, batched L3 store. Called from one storage worker thread, never the scheduler.

    Failures (server down, I/O error, corrupt entry) come back as False/None per key and are
    logged; they never raise into the caller. `set` returns True for a key only once the backend
    has confirmed the write — the producer emits `Stored(DISK|EXTERNAL)` on that confirmation.
    """

    name: str
    shared: bool  # True: one store for the fleet (EXTERNAL); False: node-local (DISK)

    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def get(self, keys: Sequence[str]) -> list[bytes | None]: ...

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        """Read each value into its writable buffer: bytes read, or -1 (absent, failed, or larger
        than its buffer). A zero-copy store reads straight into the caller's memory."""
        ...

    def set(self, keys: Sequence[str], values: Sequence[BytesLike]) -> list[bool]: ...

    def delete(self, keys: Sequence[str]) -> int: ...

    def capacity(self) -> StorageCapacity: ...

    def drain_evicted(self) -> list[str]: ...

    def knows(self, keys: list[str]) -> list[bool] | None:
        """Whether each key is held, from the backend's own index (no I/O, any thread); None when
        its contents are not known locally (a store other workers write to)."""
        ...

    def close(self) -> None: ...


def backend_medium(backend: StorageBackend) -> Medium:
    """The tier a backend's confirmed writes are announced on."""
    return Medium.EXTERNAL if backend.shared else Medium.DISK


def check_batch(keys: Sequence[str], values: Sequence[BytesLike] | None = None) -> None:
    """Programming errors in a batch (not backend failures) raise ValueError up front."""
    if isinstance(keys, (str, bytes)):
        raise ValueError("keys must be a sequence of str, not a single string")
    for k in keys:
        if not isinstance(k, str) or not k:
            raise ValueError(f"storage keys must be non-empty str, got {k!r}")
    if values is not None:
        if len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        for v in values:
            if not isinstance(v, (bytes, bytearray, memoryview)):
                raise ValueError(f"storage values must be bytes-like, got {type(v).__name__}")


def copy_into(values: Sequence[bytes | None], buffers: Sequence[memoryview]) -> list[int]:
    """`get_into` for a backend that reads values as bytes: one copy into each buffer."""
    out = []
    for v, b in zip(values, buffers):
        mv = b.cast("B") if b.format != "B" or b.ndim != 1 else b
        if v is None or len(v) > mv.nbytes:
            out.append(-1)
            continue
        mv[:len(v)] = v
        out.append(len(v))
    return out
