"""What an event transport hands to live ingestion, in per-worker seq order: `Batch`, `Run`, `Gap`,
`Restart` (`Delivery` is any of them). The ZeroMQ subscriber (indexer/subscriber.py) and the JetStream
one (indexer/jetstream_subscriber.py) both deliver these; indexer/subscriber.py's docstring says what
each means to the consumer."""
from __future__ import annotations

from typing import Union

import msgspec


class Batch(msgspec.Struct, frozen=True):
    worker_id: str
    seq: int
    payload: bytes
    recv_ts: float
    replayed: bool = False


class Run(msgspec.Struct, frozen=True):
    """Live batches `first_seq`, `first_seq + 1`, ... of one worker, in order, none replayed."""
    worker_id: str
    first_seq: int
    payloads: list[bytes]
    recv_ts: float

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.payloads) - 1


class Gap(msgspec.Struct, frozen=True):
    worker_id: str
    first: int
    last: int
    recovered: bool


class Restart(msgspec.Struct, frozen=True):
    worker_id: str
    old_seq: int
    new_seq: int


Delivery = Union[Batch, Run, Gap, Restart]
