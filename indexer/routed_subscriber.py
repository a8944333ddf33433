"""One subscriber for a mixed fleet: `jetstream:` endpoints go to the JetStreamSubscriber, all
others to the ZeroMQ Subscriber (docs/jetstream.md). Same interface as both, so
`kvatlas indexer --nats URL` keeps accepting `POST /workers` for either kind of worker."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from schemas.jetstream import is_jetstream_endpoint

if TYPE_CHECKING:
    from indexer.protocol import Subscriber
    from indexer.deliveries import Delivery


class RoutedSubscriber:
    """Delegates per worker; `poll` takes from both (JetStream without waiting when ZeroMQ waits)."""

    __slots__ = ("zmq", "js", "_owner")

    def __init__(self, zmq_subscriber: Subscriber, js_subscriber: Subscriber) -> None:
        self.zmq = zmq_subscriber
        self.js = js_subscriber
        self._owner: dict[str, Subscriber] = {}

    def add(self, worker_id: str, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
            last_seq: int | None = None) -> None:
        if worker_id in self._owner:
            raise ValueError(f"worker {worker_id!r} is already subscribed")
        sub = self.js if is_jetstream_endpoint(endpoint) else self.zmq
        sub.add(worker_id, endpoint, replay_endpoint=replay_endpoint, topic=topic, last_seq=last_seq)
        self._owner[worker_id] = sub

    def remove(self, worker_id: str) -> None:
        sub = self._owner.pop(worker_id, None)
        if sub is None:
            raise KeyError(f"unknown worker {worker_id!r}")
        sub.remove(worker_id)

    def workers(self) -> list[str]:
        return list(self._owner)

    def watermark(self, worker_id: str) -> int | None:
        return self._owner[worker_id].watermark(worker_id)

    def request_snapshot(self, worker_id: str) -> bool:
        sub = self._owner.get(worker_id)
        return bool(sub is not None and sub.request_snapshot(worker_id))

    def poll(self, timeout_ms: int) -> list[Delivery]:
        has_zmq = bool(self.zmq.workers())
        out = self.js.poll(0 if has_zmq else timeout_ms)
        if has_zmq:
            out.extend(self.zmq.poll(0 if out else timeout_ms))
        return out

    @property
    def max_per_poll(self) -> int:
        """A poll returning fewer than this took less than either transport's cap: both are drained."""
        return min(self.zmq.max_per_poll, self.js.max_per_poll)

    def frame_drops(self) -> dict[str, int]:
        return self.zmq.frame_drops()

    @property
    def stats(self) -> dict[str, Any]:
        return {"zmq": self.zmq.stats, "jetstream": self.js.stats}

    def close(self) -> None:
        try:
            self.js.close()
        finally:
            self.zmq.close()
