"""Helpers shared by the JetStream tests: a replica = JetStreamSubscriber + KVIndex applying
deliveries the way the ingest loop does (clear on Gap(recovered=False) and Restart)."""
from __future__ import annotations

import time
from typing import Any

from support.net import wait_until
from indexer.index import KVIndex
from indexer.jetstream_subscriber import JetStreamSubscriber
from indexer.deliveries import Batch, Gap, Restart
from schemas.jetstream import StreamSettings, jetstream_endpoint

MODEL = "default"


class Replica:
    def __init__(self, url: str, block_size: int, stream: StreamSettings | None = None, *,
                 shared: bool = False, **sub_options: Any) -> None:
        self.sub = JetStreamSubscriber(url, stream=stream, shared=shared, **sub_options)
        self.index = KVIndex()
        self.index.ensure_model(MODEL, block_size)
        self.log: list[Any] = []

    def add(self, wid: str, last_seq: int | None = None) -> None:
        self.sub.add(wid, jetstream_endpoint(MODEL, wid), last_seq=last_seq)

    def pump(self, timeout_ms: int = 50) -> int:
        ds = self.sub.poll(timeout_ms)
        for d in ds:
            self.log.append(d)
            if isinstance(d, Batch):
                self.index.apply_payload(MODEL, d.worker_id, 0, d.payload, rank_from_batch=True)
            elif isinstance(d, (Gap, Restart)):
                if isinstance(d, Restart) or not d.recovered:
                    self.index.clear_worker(MODEL, d.worker_id)
        return len(ds)

    def catch_up(self, marks: dict[str, int], timeout: float = 20.0) -> None:
        """Pump until every worker's watermark reached its mark (a stream seq)."""
        def done() -> bool:
            self.pump(20)
            return all((self.sub.watermark(w) or 0) >= m for w, m in marks.items())
        wait_until(done, timeout=timeout, interval=0.0)

    def kinds(self) -> list[str]:
        return [type(d).__name__ for d in self.log]

    def close(self) -> None:
        self.sub.close()


def scores(index: KVIndex, queries: list[list[int]]) -> list[list[tuple[str, int, int, dict[str, int]]]]:
    out = []
    for q in queries:
        res = index.score(MODEL, q)
        out.append(sorted((w.worker_id, w.device_blocks, w.cached_blocks, dict(w.tiers)) for w in res.workers))
    return out


def subject_last_seq(pub: Any) -> int:
    """The stream seq of the last message stored on this publisher's own subject (after flush).
    A worker's watermark reaches this, not the stream-wide last seq: other workers' messages may
    come after its last one."""
    nats = pub._nats
    js = nats.js
    return int(nats.call(lambda: js.get_last_msg(pub.stream.name, pub.subject)).seq)


def wait_all_applied(r: Replica, pubs: dict[str, Any], timeout: float = 20.0) -> None:
    """Every message each publisher stored has been taken by this replica (per-subject marks)."""
    marks = {w: subject_last_seq(p) for w, p in pubs.items()}
    r.catch_up(marks, timeout)


def stream_last_seq(pub: Any) -> int:
    """The stream seq of the last message the publisher stored (after flush)."""
    nats = pub._nats
    js = nats.js
    info = nats.call(lambda: js.stream_info(pub.stream.name))
    return int(info.state.last_seq)
