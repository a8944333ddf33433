"""L3 storage for the producer: backend interface, file/Redis/memory/Mooncake backends, storage worker."""
from __future__ import annotations

from .base import BytesLike, StorageBackend, StorageCapacity, backend_medium
from .config import BACKEND_KINDS, load_backend_config, make_storage_backend
from .file_backend import FileStorageBackend
from .keys import hash_hex, page_key, page_keys, split_key
from .memory_backend import MemoryStorageBackend
from .worker import StorageResult, StorageWorker


def __getattr__(name: str) -> object:
    # redis-py is imported only by code that uses the Redis backend
    if name == "RedisStorageBackend":
        from .redis_backend import RedisStorageBackend

        return RedisStorageBackend
    if name == "MooncakeStorageBackend":  # the Mooncake client likewise
        from .mooncake_backend import MooncakeStorageBackend

        return MooncakeStorageBackend
    raise AttributeError(name)


__all__ = [
    "BACKEND_KINDS",
    "BytesLike",
    "FileStorageBackend",
    "MemoryStorageBackend",
    "MooncakeStorageBackend",
    "RedisStorageBackend",
    "StorageBackend",
    "StorageCapacity",
    "StorageResult",
    "StorageWorker",
    "backend_medium",
    "hash_hex",
    "load_backend_config",
    "make_storage_backend",
    "page_key",
    "page_keys",
    "split_key",
]
