"""ZeroMQ frame constants of the KV event stream, shared by the publisher (producer.publisher) and
the subscriber (indexer.subscriber) so the two ends cannot drift apart (docs/CONTRACTS.md).

Live PUB message: `[topic, seq, payload]`, seq an unsigned SEQ_BYTES-byte big-endian integer.
Replay (DEALER -> ROUTER): `[b"", start_seq]`; answers `[b"", topic, seq, payload]` per buffered
batch (vLLM / SGLang omit the topic), then `[b"", b"", END_SEQ, b""]` (or `[b"", END_SEQ, b""]`).
Pure constants and two helpers: no sockets, no imports beyond the standard library.
"""
from __future__ import annotations

from typing import Literal

SEQ_BYTES = 8
SEQ_ORDER: Literal["big"] = "big"
# The replay end marker: -1 as a signed seq (no real seq is that large unsigned).
END_SEQ = (-1).to_bytes(SEQ_BYTES, SEQ_ORDER, signed=True)
# A kvatlas extension on the replay socket: `[b"", SNAPSHOT_REQUEST]` asks a kvatlas producer to
# publish, in-stream, one batch that starts with AllBlocksCleared and re-stores everything it holds.
# No reply is sent. Engines without the extension read it as a replay from a huge seq and send only
# an end marker.
SNAPSHOT_REQUEST = b"KVATLAS-SNAPSHOT"


def seq_bytes(seq: int) -> bytes:
    """A seq as its wire frame."""
    return seq.to_bytes(SEQ_BYTES, SEQ_ORDER)


def seq_of(frame: bytes) -> int:
    """A wire seq frame (caller checked `len(frame) == SEQ_BYTES`) as an int."""
    return int.from_bytes(frame, SEQ_ORDER)
