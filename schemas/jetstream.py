"""The NATS JetStream event plane's wire contract (docs/jetstream.md): subjects, headers, names.

Pure: no I/O. Shared by the JetStream publisher (producer), the relay and the JetStream subscriber.

- Subject per (model, worker): `<prefix>.<model token>.<worker token>`, prefix `kvatlas.events`.
  A token is the name's UTF-8 bytes with every byte outside `[A-Za-z0-9_-]` written `%XX` (upper
  hex), so `.`, `*`, `>` and whitespace never reach the subject and the mapping is reversible.
- Payload: the exact ZeroMQ payload bytes (msgpack batch, design §2).
- Headers: `Kvatlas-Seq` (publisher seq, decimal), `Kvatlas-Epoch` (one value per publisher
  incarnation: a restart mints a new one), `Nats-Msg-Id` = `<worker token>.<epoch>.<seq>` so a
  re-sent batch (a relay restart) is dropped by JetStream's duplicate window.
- A batch larger than what one NATS message may carry (the server's `max_payload`, 1 MiB by
  default, less `PART_HEADROOM` for headers) is stored as consecutive parts of one seq: header
  `Kvatlas-Part: <i>/<n>`, `Nats-Msg-Id` `<id>.p<i>`. Consumers apply it once its last part is
  read (the part's stream seq is then the watermark); parts whose run is broken are dropped.
- Snapshot requests travel on core NATS: `<control prefix>.<model token>.<worker token>`.
"""
from __future__ import annotations

from typing import Final

import msgspec

EVENTS_PREFIX: Final = "kvatlas.events"
CONTROL_PREFIX: Final = "kvatlas.control.snapshot"
DEFAULT_STREAM: Final = "KVATLAS_EVENTS"
DEFAULT_KV_BUCKET: Final = "kvatlas_workers"
ENDPOINT_SCHEME: Final = "jetstream:"  # RegisterWorker.endpoint of a worker read from JetStream

HDR_SEQ: Final = "Kvatlas-Seq"
HDR_EPOCH: Final = "Kvatlas-Epoch"
HDR_MSG_ID: Final = "Nats-Msg-Id"
HDR_PART: Final = "Kvatlas-Part"  # "<i>/<n>": part i of a batch stored as n messages (module doc)
PART_HEADROOM: Final = 4096  # bytes of max_payload left for the headers of a part
MAX_PARTS: Final = 1 << 16

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
# NATS KV keys allow [-/_=.A-Za-z0-9]; '=' is our escape character there.
_KV_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def _escape(name: str, safe: frozenset[int], esc: str) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a model or worker name must be a non-empty string, got {name!r}")
    return "".join(chr(b) if b in safe else f"{esc}{b:02X}" for b in name.encode("utf-8"))


def _unescape(token: str, esc: str) -> str:
    out = bytearray()
    i = 0
    while i < len(token):
        c = token[i]
        if c == esc:
            hx = token[i + 1:i + 3]
            if len(hx) != 2:
                raise ValueError(f"bad escape in token {token!r}")
            out.append(int(hx, 16))
            i += 3
        else:
            out += c.encode("ascii")
            i += 1
    return out.decode("utf-8")


def subject_token(name: str) -> str:
    """A model/worker name as one NATS subject token (reversible, see module doc)."""
    return _escape(name, _SAFE, "%")


def token_name(token: str) -> str:
    return _unescape(token, "%")


def event_subject(model: str, worker_id: str, prefix: str = EVENTS_PREFIX) -> str:
    return f"{prefix}.{subject_token(model)}.{subject_token(worker_id)}"


def control_subject(model: str, worker_id: str, prefix: str = CONTROL_PREFIX) -> str:
    return f"{prefix}.{subject_token(model)}.{subject_token(worker_id)}"


def split_subject(subject: str, prefix: str) -> tuple[str, str]:
    """`<prefix>.<model>.<worker>` -> (model, worker); ValueError when it is not one."""
    head = prefix + "."
    if not subject.startswith(head):
        raise ValueError(f"subject {subject!r} is not under {prefix!r}")
    parts = subject[len(head):].split(".")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"subject {subject!r} is not <prefix>.<model>.<worker>")
    return token_name(parts[0]), token_name(parts[1])


def jetstream_endpoint(model: str, worker_id: str, prefix: str = EVENTS_PREFIX) -> str:
    """The `RegisterWorker.endpoint` of a worker whose events are read from JetStream."""
    return ENDPOINT_SCHEME + event_subject(model, worker_id, prefix)


def is_jetstream_endpoint(endpoint: str) -> bool:
    return endpoint.startswith(ENDPOINT_SCHEME)


def endpoint_subject(endpoint: str) -> str:
    """`jetstream:<subject>` -> subject; ValueError for anything else."""
    if not is_jetstream_endpoint(endpoint):
        raise ValueError(f"not a JetStream endpoint (expected {ENDPOINT_SCHEME}<subject>): {endpoint!r}")
    subject = endpoint[len(ENDPOINT_SCHEME):]
    tokens = subject.split(".")
    if not subject or any(not t or t in ("*", ">") or any(ch.isspace() for ch in t) for t in tokens):
        raise ValueError(f"bad JetStream subject in endpoint {endpoint!r}")
    return subject


def msg_id(worker_token: str, epoch: str, seq: int) -> str:
    return f"{worker_token}.{epoch}.{seq}"


def part_msg_id(worker_token: str, epoch: str, seq: int, part: int) -> str:
    return f"{worker_token}.{epoch}.{seq}.p{part}"


def kv_key(worker_id: str) -> str:
    """A worker id as a NATS KV key (`=XX` escapes, reversible)."""
    return _escape(worker_id, _KV_SAFE, "=")


def kv_key_name(key: str) -> str:
    return _unescape(key, "=")


class StreamSettings(msgspec.Struct, frozen=True):
    """The events stream: one per deployment, every (model, worker) subject under `prefix`.
    Retention by age and/or bytes (0 = unlimited); `duplicate_window_s` bounds Nats-Msg-Id dedup."""

    name: str = DEFAULT_STREAM
    prefix: str = EVENTS_PREFIX
    max_age_s: float = 24 * 3600.0
    max_bytes: int = 0
    duplicate_window_s: float = 120.0
    storage: str = "file"  # "file" or "memory"
    replicas: int = 1


class EventHeaders(msgspec.Struct, frozen=True):
    """The kvatlas headers of one stored message, parsed."""

    seq: int
    epoch: str
    part: int = 0  # HDR_PART: this message is part `part` of `parts`
    parts: int = 1


def parse_headers(headers: dict[str, str] | None) -> EventHeaders | str:
    """Headers -> EventHeaders, or a str saying why they are not ours (the message is dropped)."""
    if not headers:
        return "no headers"
    raw_seq = headers.get(HDR_SEQ)
    epoch = headers.get(HDR_EPOCH)
    if raw_seq is None or epoch is None:
        return f"missing {HDR_SEQ} or {HDR_EPOCH} header"
    try:
        seq = int(raw_seq)
    except ValueError:
        return f"{HDR_SEQ} header {raw_seq!r} is not an integer"
    if seq < 0:
        return f"{HDR_SEQ} header {seq} is negative"
    if not epoch:
        return f"empty {HDR_EPOCH} header"
    if seq >= 1 << 64:
        return f"{HDR_SEQ} header {seq} does not fit 64 bits"
    raw_part = headers.get(HDR_PART)
    if raw_part is None:
        return EventHeaders(seq, epoch)
    i, sep, n = raw_part.partition("/")
    try:
        part, parts = int(i), int(n)
    except ValueError:
        return f"{HDR_PART} header {raw_part!r} is not <i>/<n>"
    if not sep or not 0 <= part < parts <= MAX_PARTS:
        return f"{HDR_PART} header {raw_part!r} is not <i>/<n> with 0 <= i < n <= {MAX_PARTS}"
    return EventHeaders(seq, epoch, part, parts)
