"""Embedded default L3: one file per key under a root directory.

Each file is `header | key | value`; the header carries a magic, both lengths and a CRC32 of the
value, so a truncated or corrupted file is detected on read (-> None, file removed, key reported
as evicted) instead of returning garbage KV. Writes are atomic (temp file in the same filesystem,
then rename). A byte capacity is enforced with LRU eviction; keys the store drops on its own are
reported by `drain_evicted()` so the producer can emit `Removed(DISK|EXTERNAL)`.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import struct
import threading
import zlib
from collections.abc import Sequence

from .base import BytesLike, check_batch
from .ledger import LedgerAccounting, LruLedger

log = logging.getLogger(__name__)

MAGIC = b"KVATL3v1"
_HEADER = struct.Struct(">8sIQI")  # magic, key_len, value_len, crc32(value)
_SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,150}\Z")
_SUFFIX = ".kv"
_TMP_DIR = ".tmp"


def key_filename(key: str) -> str:
    """Filesystem-safe name for a key. Plain keys (hash hex) map to themselves; anything else
    (slashes, unicode, very long) to a digest, `~` marking it so the two spaces cannot collide."""
    if _SAFE_NAME.match(key):
        return key + _SUFFIX
    return "~" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest() + _SUFFIX


def key_shard(key: str) -> str:
    """Two hex chars: spreads files over 256 subdirectories so no directory grows huge."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=1).hexdigest()


def encode_entry_header(key: bytes, value_len: int, crc: int) -> bytes:
    return _HEADER.pack(MAGIC, len(key), value_len, crc) + key


class FileStorageBackend(LedgerAccounting):
    __slots__ = (
        "root", "shared", "name", "_fsync", "_ledger", "_evicted", "_lock", "_tmp_ids",
        "corrupt_entries", "write_failures",
    )

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int | None = None,
        shared: bool = False,
        *,
        fsync: bool = False,
        name: str | None = None,
    ) -> None:
        self.root = os.fspath(root)
        self.shared = bool(shared)
        self.name = name or f"file:{self.root}"
        self._fsync = fsync
        self._ledger = LruLedger(capacity_bytes)
        self._evicted: list[str] = []
        self._lock = threading.RLock()
        self._tmp_ids = itertools.count()
        self.corrupt_entries = 0
        self.write_failures = 0
        try:
            os.makedirs(os.path.join(self.root, _TMP_DIR), exist_ok=True)
        except OSError as exc:
            raise ValueError(f"file storage root {self.root!r} is not usable: {exc}") from exc
        self._scan()

    # -- paths -------------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return os.path.join(self.root, key_shard(key), key_filename(key))

    # -- startup -----------------------------------------------------------------------------
    def _scan(self) -> None:
        """Rebuild the LRU ledger from disk (oldest mtime first) and clear stale temp files."""
        tmp = os.path.join(self.root, _TMP_DIR)
        for entry in os.scandir(tmp):
            if entry.name.startswith(f"{os.getpid()}-") or not self.shared:
                _unlink_quietly(entry.path)
        found: list[tuple[float, str, int]] = []
        for shard in os.scandir(self.root):
            if not shard.is_dir() or shard.name == _TMP_DIR or len(shard.name) != 2:
                continue
            for entry in os.scandir(shard.path):
                if not entry.name.endswith(_SUFFIX):
                    continue
                key = _read_key(entry.path)
                if key is None or self._path(key) != entry.path:
                    self.corrupt_entries += 1
                    log.warning("removing unreadable L3 file %s", entry.path)
                    _unlink_quietly(entry.path)
                    continue
                st = entry.stat()
                found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._ledger.put(key, size)
        if found:
            log.info("file storage %s: recovered %d entries (%d bytes)", self.root, len(found), self._ledger.used_bytes)
        self._enforce_limit(protect=())

    # -- helpers -----------------------------------------------------------------------------
    def _lost(self, key: str) -> None:
        """The store no longer holds a key it had: account and report it."""
        if self._ledger.remove(key) is not None:
            self._evicted.append(key)

    def _enforce_limit(self, protect: Sequence[str], incoming: int = 0) -> None:
        for victim in self._ledger.victims(incoming, protect):
            _unlink_quietly(self._path(victim))
            self._lost(victim)

    # -- StorageBackend ----------------------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> list[bool]:
        check_batch(keys)
        out: list[bool] = []
        with self._lock:
            for key in keys:
                path = self._path(key)
                try:
                    size = os.stat(path).st_size
                except OSError:
                    self._lost(key)  # deleted behind our back
                    out.append(False)
                    continue
                if key not in self._ledger:  # written by another process sharing the root
                    self._ledger.put(key, size)
                out.append(True)
        return out

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        check_batch(keys)
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                value = self._read(key)
                if value is not None:
                    self._ledger.touch(key)
                out.append(value)
        return out

    def _read(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._lost(key)
            return None
        except OSError as exc:
            log.warning("L3 read of %r failed: %s", key, exc)
            return None
        value = _decode_entry(data, key)
        if value is None:
            self.corrupt_entries += 1
            log.warning("corrupt L3 file for key %r (%s); removing it", key, path)
            _unlink_quietly(path)
            self._lost(key)
            return None
        try:
            os.utime(path)  # keeps LRU order across restarts
        except OSError:
            pass
        return value

    def set(self, keys: Sequence[str], values: Sequence[BytesLike]) -> list[bool]:
        check_batch(keys, values)
        out: list[bool] = []
        with self._lock:
            for key, value in zip(keys, values):
                out.append(self._write(key, value))
        return out

    def _write(self, key: str, value: BytesLike) -> bool:
        kb = key.encode("utf-8", "surrogatepass")
        mv = memoryview(value).cast("B")
        header = encode_entry_header(kb, mv.nbytes, zlib.crc32(mv))
        size = len(header) + mv.nbytes
        if not self._ledger.fits(size):
            self.write_failures += 1
            log.warning("L3 value for %r (%d bytes) exceeds the store capacity %s", key, size, self._ledger.limit_bytes)
            return False
        old = self._ledger.remove(key)  # overwrite: the old bytes are replaced, not evicted
        # plain LRU: earlier members of this batch are the most recent, so they go last
        self._enforce_limit(protect=(), incoming=size)
        path = self._path(key)
        tmp = os.path.join(self.root, _TMP_DIR, f"{os.getpid()}-{threading.get_ident()}-{next(self._tmp_ids)}.tmp")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(mv)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            self.write_failures += 1
            log.warning("L3 write of %r failed: %s", key, exc)
            _unlink_quietly(tmp)
            if old is not None:
                # the previous file is still in place (rename never happened)
                if os.path.exists(path):
                    self._ledger.put(key, old)
                else:
                    self._evicted.append(key)
            return False
        self._ledger.put(key, size)
        return True

    def delete(self, keys: Sequence[str]) -> int:
        check_batch(keys)
        n = 0
        with self._lock:
            for key in keys:
                self._ledger.remove(key)
                try:
                    os.unlink(self._path(key))
                    n += 1
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("L3 delete of %r failed: %s", key, exc)
        return n



def _decode_entry(data: bytes, key: str) -> bytes | None:
    if len(data) < _HEADER.size:
        return None
    magic, klen, vlen, crc = _HEADER.unpack_from(data)
    if magic != MAGIC or _HEADER.size + klen + vlen != len(data):
        return None
    start = _HEADER.size
    if data[start : start + klen] != key.encode("utf-8", "surrogatepass"):
        return None
    value = data[start + klen :]
    if zlib.crc32(value) != crc:
        return None
    return value


def _read_key(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
            if len(head) != _HEADER.size:
                return None
            magic, klen, vlen, _ = _HEADER.unpack(head)
            if magic != MAGIC or klen > 4096:
                return None
            kb = f.read(klen)
            size = os.fstat(f.fileno()).st_size
        if len(kb) != klen or size != _HEADER.size + klen + vlen:
            return None
        return kb.decode("utf-8", "surrogatepass")
    except (OSError, UnicodeDecodeError):
        return None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)
