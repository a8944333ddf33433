"""One conformance suite for the event transports behind `indexer.protocol.Subscriber`: the ZeroMQ
subscriber (real PUB/SUB sockets), the JetStream subscriber (a real `nats-server -js`) and the
routed subscriber over both. Each test states a rule live ingestion relies on; transport-specific
behaviour (replays, gaps, stream trimming, hostile peers) stays in the transport's own tests.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from indexer.jetstream_subscriber import JetStreamSubscriber
from indexer.protocol import Subscriber
from indexer.routed_subscriber import RoutedSubscriber
from indexer.deliveries import Batch
from indexer.subscriber import ZmqSubscriber
from transport.jetstream_publisher import JetStreamEventPublisher
from producer.publisher import ZmqEventPublisher
from schemas.codec import decode_batch
from schemas.events import BlockStored
from schemas.jetstream import jetstream_endpoint
from support.nats import NatsServer
from support.net import wait_until

MODEL = "default"


@dataclass
class Worker:
    """A real publisher and the `add` arguments that subscribe to it."""

    pub: Any
    endpoint: str
    replay_endpoint: str | None


@dataclass
class Transport:
    sub: Subscriber
    worker: Callable[[str], Worker]


@pytest.fixture(params=["zmq", "jetstream", "routed"])
def transport(request: pytest.FixtureRequest) -> Iterator[Transport]:
    pubs: list[Any] = []
    nats: NatsServer | None = None

    def zmq_worker(wid: str) -> Worker:
        pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
        pubs.append(pub)
        return Worker(pub, pub.endpoint, pub.replay_endpoint)

    def js_worker(wid: str) -> Worker:
        assert nats is not None
        pub = JetStreamEventPublisher(nats.url, model=MODEL, worker_id=wid)
        pubs.append(pub)
        return Worker(pub, jetstream_endpoint(MODEL, wid), None)

    if request.param == "zmq":
        sub: Subscriber = ZmqSubscriber(replay_timeout=1.0, max_per_poll=4)
        worker = zmq_worker
    else:
        nats = NatsServer().start()
        js = JetStreamSubscriber(nats.url, max_per_poll=4)
        if request.param == "jetstream":
            sub, worker = js, js_worker
        else:  # one worker of each kind, alternately
            sub = RoutedSubscriber(ZmqSubscriber(replay_timeout=1.0, max_per_poll=4), js)
            kinds = [js_worker, zmq_worker]
            worker = lambda wid: kinds[len(pubs) % 2](wid)  # noqa: E731
    try:
        yield Transport(sub, worker)
    finally:
        sub.close()
        for p in pubs:
            p.close()
        if nats is not None:
            nats.stop()


def _batches(sub: Subscriber, wid: str, n: int, timeout: float = 20.0, heartbeat: Any = None,
             events_only: bool = False) -> list[Batch]:
    """Poll until `n` batches of `wid` arrived (heartbeating `heartbeat` meanwhile, if given;
    `events_only`: heartbeats, which may still be in flight, do not count)."""
    got: list[Batch] = []

    def enough() -> bool:
        if heartbeat is not None:
            heartbeat.heartbeat()
        got.extend(d for d in sub.poll(20) if isinstance(d, Batch) and d.worker_id == wid
                   and (not events_only or decode_batch(d.payload).events))
        return len(got) >= n

    wait_until(enough, timeout=timeout, interval=0.0)
    return got


def _connected(t: Transport, wid: str) -> Worker:
    """A subscribed worker whose stream is known to flow (a PUB drops what it sends before the SUB joined)."""
    w = t.worker(wid)
    t.sub.add(wid, w.endpoint, replay_endpoint=w.replay_endpoint)
    _batches(t.sub, wid, 1, heartbeat=w.pub)
    assert w.pub.flush(10)
    return w


def test_implements_the_declared_protocol(transport: Transport) -> None:
    assert isinstance(transport.sub, Subscriber)
    assert transport.sub.max_per_poll == 4
    assert transport.sub.frame_drops() == {}


def test_membership(transport: Transport) -> None:
    sub = transport.sub
    a, b = transport.worker("a"), transport.worker("b")
    sub.add("a", a.endpoint, replay_endpoint=a.replay_endpoint)
    sub.add("b", b.endpoint, replay_endpoint=b.replay_endpoint)
    assert sorted(sub.workers()) == ["a", "b"]
    with pytest.raises(ValueError):
        sub.add("a", a.endpoint, replay_endpoint=a.replay_endpoint)
    sub.remove("a")
    assert sub.workers() == ["b"]
    with pytest.raises(KeyError):
        sub.remove("a")
    assert sub.watermark("b") is None  # nothing delivered yet


def test_batches_arrive_in_order_byte_exact_and_move_the_watermark(transport: Transport) -> None:
    sub = transport.sub
    w = _connected(transport, "w")
    sent = [[BlockStored([100 + i], 100 + i - 1 if i else None, [i] * 4, 4, None, medium="GPU")] for i in range(10)]
    for events in sent:
        w.pub.publish(events)
    assert w.pub.flush(10)
    got = _batches(sub, "w", len(sent), events_only=True)
    assert [decode_batch(d.payload).events for d in got] == sent
    seqs = [d.seq for d in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert sub.watermark("w") == seqs[-1]


def test_a_poll_takes_at_most_max_per_poll(transport: Transport) -> None:
    sub = transport.sub
    w = _connected(transport, "w")
    for i in range(12):
        w.pub.publish([BlockStored([i + 1], None, [i] * 4, 4, None)])
    assert w.pub.flush(10)
    sizes: list[int] = []

    def drained() -> bool:
        ds = sub.poll(20)
        sizes.append(len(ds))
        return sum(sizes) >= 12

    wait_until(drained, timeout=20, interval=0.0)
    assert max(sizes) <= sub.max_per_poll


def test_a_snapshot_request_reaches_the_publisher(transport: Transport) -> None:
    sub = transport.sub
    w = _connected(transport, "w")
    assert sub.request_snapshot("nobody") is False
    assert sub.request_snapshot("w") is True
    wait_until(lambda: (sub.poll(10), w.pub.snapshot_requested())[1], timeout=20, interval=0.0)


def test_close_is_idempotent_and_a_closed_subscriber_delivers_nothing(transport: Transport) -> None:
    sub = transport.sub
    w = _connected(transport, "w")
    sub.close()
    w.pub.publish([BlockStored([1], None, [0] * 4, 4, None)])
    assert sub.poll(10) == []
    sub.close()
