"""Event sinks for producer tests: the encoded payloads a publisher would send, kept in memory."""
from __future__ import annotations

from producer.sinks import _PayloadSink

class BytesSink(_PayloadSink):
    """The payloads a publisher would send, with a fixed timestamp so two runs compare bytewise."""

    __slots__ = ("payloads", "ts")

    def __init__(self, ts: float = 0.0) -> None:
        self.payloads: list[bytes] = []
        self.ts = ts

    def batch_ts(self) -> float:
        return self.ts

    def send_payload(self, payload: bytes) -> None:
        self.payloads.append(payload)

    def close(self) -> None:
        pass
