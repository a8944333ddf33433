"""Indexer snapshots: registered workers, per-worker seq watermarks and the index state, as one
msgpack blob written atomically to a file (temp + fsync + rename) or to Redis (MULTI/EXEC of one
SET plus a generation counter). A restarted indexer loads it, then asks each publisher to replay
from its watermark.

The snapshot is encoded by the caller's thread; stores only move bytes. On the wire it is framed
(`encode_snapshot`): a magic, the format version, the payload's length and a SHA-256 over all three and
the payload, so a flipped bit anywhere, a truncated or padded file, or another format is refused
before anything is decoded, like a file that is not a snapshot at all.
"""
from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
from typing import Optional, Protocol, cast

import msgspec

from schemas.api import RegisterWorker
from schemas.events import KVEvent

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 2
SNAPSHOT_MAGIC = b"KVATLAS-SNAPSHOT"
_HEAD = struct.Struct(">16sIQ")  # magic, version, payload length
_DIGEST = 32                     # SHA-256 of head + payload, after the head


class SnapshotError(Exception):
    """A snapshot could not be written, read or decoded (message says which and why)."""


class WorkerSnapshot(msgspec.Struct):
    reg: RegisterWorker
    last_seq: Optional[int]  # the watermark: last batch applied to `index`
    dp_ranks: list[int]
    clean: bool = True  # StreamState.clean: False while a loss is unanswered (the view is not exact)


class ModelSnapshot(msgspec.Struct):
    model: str
    block_size: int
    # KVIndex.dump(model): per (worker, dp_rank) the events that rebuild its blocks.
    workers: list[tuple[str, int, list[KVEvent]]]


class Snapshot(msgspec.Struct):
    version: int
    generation: int
    created_ts: float
    workers: list[WorkerSnapshot]
    models: list[ModelSnapshot]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Snapshot)


def encode_snapshot(snap: Snapshot) -> bytes:
    """The framed snapshot: head (magic, version, length), SHA-256 of head + payload, payload."""
    payload = _encoder.encode(snap)
    head = _HEAD.pack(SNAPSHOT_MAGIC, SNAPSHOT_VERSION, len(payload))
    digest = hashlib.sha256(head)
    digest.update(payload)
    return b"".join((head, digest.digest(), payload))


def verified_payload(data: bytes) -> memoryview:
    """The payload of a framed snapshot whose head and checksum hold (SnapshotError otherwise)."""
    n = _HEAD.size + _DIGEST
    if len(data) < n:
        raise SnapshotError(f"snapshot is corrupt: {len(data)} bytes, shorter than its {n}-byte head")
    magic, version, length = _HEAD.unpack_from(data)
    if magic != SNAPSHOT_MAGIC:
        raise SnapshotError("snapshot is corrupt or not a kvatlas snapshot (bad magic)")
    if version != SNAPSHOT_VERSION:
        raise SnapshotError(f"snapshot version {version} is not {SNAPSHOT_VERSION}")
    if length != len(data) - n:
        raise SnapshotError(f"snapshot is corrupt: its head says {length} payload bytes, {len(data) - n} follow")
    view = memoryview(data)
    digest = hashlib.sha256(view[:_HEAD.size])
    digest.update(view[n:])
    if digest.digest() != bytes(view[_HEAD.size:n]):
        raise SnapshotError("snapshot is corrupt: checksum mismatch")
    return view[n:]


def decode_snapshot(data: bytes) -> Snapshot:
    payload = verified_payload(data)
    try:
        snap = _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SnapshotError(f"snapshot is corrupt or from an incompatible version: {exc}") from exc
    if snap.version != SNAPSHOT_VERSION:
        raise SnapshotError(f"snapshot version {snap.version} is not {SNAPSHOT_VERSION}")
    return snap


class SnapshotStore(Protocol):
    """Where snapshots live. `save` replaces the previous one atomically."""

    description: str

    def save(self, data: bytes) -> None: ...

    def load(self) -> bytes | None: ...

    def close(self) -> None: ...


class FileSnapshotStore:
    __slots__ = ("path", "description")

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self.description = f"file:{self.path}"

    def save(self, data: bytes) -> None:
        directory = os.path.dirname(self.path)
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".snapshot-", dir=directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)  # readers see the old or the new file, never half
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError as exc:
            raise SnapshotError(f"cannot write snapshot {self.path}: {exc}") from exc

    def load(self) -> bytes | None:
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SnapshotError(f"cannot read snapshot {self.path}: {exc}") from exc

    def close(self) -> None:
        pass


class RedisSnapshotStore:
    """One key holds the blob; `<key>:generation` counts successful saves (same transaction)."""

    __slots__ = ("url", "key", "description", "_client")

    def __init__(self, url: str, key: str = "kvatlas:snapshot", timeout_s: float = 10.0) -> None:
        import redis  # runtime dependency; imported here so file-only users never touch it

        self.url = url
        self.key = key
        self.description = f"{_redact(url)} key={key}"
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )

    def save(self, data: bytes) -> None:
        import redis

        try:
            pipe = self._client.pipeline(transaction=True)
            pipe.set(self.key, data)
            pipe.incr(self.key + ":generation")
            pipe.execute()
        except redis.RedisError as exc:
            raise SnapshotError(f"cannot write snapshot to {self.description}: {exc}") from exc

    def load(self) -> bytes | None:
        import redis

        try:
            return cast("bytes | None", self._client.get(self.key))  # a client without decode_responses
        except redis.RedisError as exc:
            raise SnapshotError(f"cannot read snapshot from {self.description}: {exc}") from exc

    def generation(self) -> int:
        import redis

        try:
            return int(self._client.get(self.key + ":generation") or 0)
        except redis.RedisError as exc:
            raise SnapshotError(f"cannot read generation from {self.description}: {exc}") from exc

    def close(self) -> None:
        self._client.close()


def _redact(url: str) -> str:
    # redis://user:password@host -> redis://***@host, so logs never carry credentials
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url


def make_snapshot_store(target: str | None, key: str = "kvatlas:snapshot") -> SnapshotStore | None:
    """`redis://…`/`rediss://…`/`unix://…` → Redis; `file://path` or a plain path → file; empty → None."""
    if not target:
        return None
    if target.startswith(("redis://", "rediss://", "unix://")):
        return RedisSnapshotStore(target, key=key)
    if target.startswith("file://"):
        target = target[len("file://"):]
    if "://" in target:
        raise ValueError(f"unsupported snapshot target {target!r}: use redis://… or a file path")
    return FileSnapshotStore(target)
