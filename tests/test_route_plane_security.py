"""The NATS route plane under attack (issue 37, finding 4), against a real nats-server started with a
config file: only the replicas' user may use the subject (credentials and permissions, the setup
docs/reference.md describes), every message carries an HMAC under the replicas' shared secret, and
what a replica applies is validated with the HTTP schema's bounds and queued within a bound."""
from __future__ import annotations

import math
import time
from collections.abc import Iterator

import msgspec
import pytest

from router_api.config import ServiceConfig
from router_api.route_plane import DEFAULT_ROUTES_SUBJECT, RouteFanout, seal
from router_api.service import IndexerService
from schemas.api import RegisterWorker
from transport.natsio import NatsThread, NatsUnavailable
from support.nats import ROUTE_PLANE_USERS_CONF, NatsServer
from support.net import free_port, wait_until

BS = 4
SECRET = b"replicas-only"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    conf = tmp_path_factory.mktemp("nats-conf") / "nats.conf"
    conf.write_text(ROUTE_PLANE_USERS_CONF)
    with NatsServer(config=str(conf)) as srv:
        yield srv


def _url(srv: NatsServer, user: str, pw: str) -> str:
    return f"nats://{user}:{pw}@127.0.0.1:{srv.port}"


class Replica:
    def __init__(self, url: str, secret: bytes | None = SECRET, max_queued: int = 8192) -> None:
        self.svc = IndexerService(ServiceConfig(port=free_port(), block_size=BS, stale_after_s=1e6,
                                                remove_after_s=2e6))
        self.svc.start()
        self.svc.register(RegisterWorker("w0", f"tcp://127.0.0.1:{free_port()}", block_size=BS))
        self.nats = NatsThread(url)
        self.fanout = RouteFanout(self.nats, self.svc, secret=secret, max_queued=max_queued)
        self.svc.route_fanout = self.fanout

    def count(self, outcome: str) -> float:
        return self.fanout.counts.get("in", outcome)

    def close(self) -> None:
        self.fanout.close()
        self.nats.close()
        self.svc.stop(final_snapshot=False)


@pytest.fixture
def pair(server: NatsServer) -> Iterator[tuple[Replica, Replica]]:
    a, b = Replica(_url(server, "indexer", "ipw")), Replica(_url(server, "indexer", "ipw"))
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _publish(nt: NatsThread, data: bytes) -> None:
    nt.call(lambda: nt.nc.publish(DEFAULT_ROUTES_SUBJECT, data))
    nt.call(lambda: nt.nc.flush())


def _add(rid: str, **kw: object) -> dict:
    return {"origin": "evil", "op": "add", "model": "default", "request_id": rid, "worker_id": "w0",
            "keys": [11, 12], **kw}


def _raw(msg: dict) -> bytes:
    order = ["origin", "op", "model", "request_id", "worker_id", "dp_rank", "keys", "tokens", "busy_until", "admits"]
    defaults = {"dp_rank": 0, "keys": [], "tokens": -1, "busy_until": None, "admits": False}
    return msgspec.msgpack.encode([msg.get(k, defaults.get(k)) for k in order])


def test_only_the_replicas_user_reaches_the_subject(server: NatsServer, pair: tuple[Replica, Replica]) -> None:
    a, b = pair
    with pytest.raises(NatsUnavailable):
        NatsThread(f"nats://127.0.0.1:{server.port}", connect_timeout=2.0).close()  # no credentials
    with pytest.raises(NatsUnavailable):
        NatsThread(_url(server, "indexer", "wrong"), connect_timeout=2.0).close()
    # a worker's credentials: neither reading route ids off the subject nor writing to it
    spy = NatsThread(_url(server, "worker", "wpw"))
    seen: list[bytes] = []

    async def on_msg(msg: object) -> None:
        seen.append(msg.data)

    try:
        spy.call(lambda: spy.nc.subscribe(DEFAULT_ROUTES_SUBJECT, cb=on_msg))
        spy.call(lambda: spy.nc.publish(DEFAULT_ROUTES_SUBJECT, seal(SECRET, _raw(_add("forged")), time.time())))
        toks = list(range(100, 100 + 2 * BS))
        a.svc.report_route("default", "legit-id", "w0", toks)
        wait_until(lambda: b.svc.routes.pending.get("default", "legit-id") is not None, timeout=20)
        assert seen == []  # the server refused the subscription: no route id was read
        assert b.svc.routes.pending.get("default", "forged") is None and b.count("add") == 1
    finally:
        spy.close()


def test_unsigned_forged_and_replayed_messages_are_dropped(server: NatsServer,
                                                          pair: tuple[Replica, Replica]) -> None:
    a, b = pair
    toks = list(range(200, 200 + 2 * BS))
    a.svc.report_route("default", "victim", "w0", toks)
    wait_until(lambda: b.svc.routes.pending.get("default", "victim") is not None, timeout=20)
    insider = NatsThread(_url(server, "indexer", "ipw"))  # right credentials, no secret
    try:
        release = {"origin": "evil", "op": "release", "model": "default", "request_id": "victim"}
        _publish(insider, _raw(release))                                      # unsigned
        _publish(insider, seal(b"guessed", _raw(release), time.time()))        # another key
        _publish(insider, seal(SECRET, _raw(release), time.time() - 3600))     # an old one, replayed
        wait_until(lambda: b.count("unauthenticated") == 2 and b.count("stale") == 1, timeout=20)
        assert b.svc.routes.pending.get("default", "victim") is not None  # still held on both
        assert a.svc.routes.pending.get("default", "victim") is not None
    finally:
        insider.close()


def test_bad_values_are_refused_and_the_queue_is_bounded(server: NatsServer) -> None:
    b = Replica(_url(server, "indexer", "ipw"), max_queued=64)
    bad = NatsThread(_url(server, "indexer", "ipw"))  # a replica gone bad: right key, wrong values
    try:
        now = time.time()
        for i, msg in enumerate([_add("inf", busy_until=math.inf), _add("nan", busy_until=math.nan),
                                 _add("huge", busy_until=1e300), _add("tokens", tokens=(1 << 63) - 1),
                                 _add("neg", keys=[-1]), _add("rank", dp_rank=1 << 20), _add("", keys=[1])]):
            _publish(bad, seal(SECRET, _raw(msg), now))
        _publish(bad, seal(SECRET, _raw(_add("honest", busy_until=50.0, tokens=8)), now))
        wait_until(lambda: b.svc.routes.pending.get("default", "honest") is not None, timeout=20)
        assert b.count("bad") == 7 and len(b.svc.routes.pending) == 1
        assert b.svc.routes.load("default", "w0", 0, b.svc.clock()) == (1, 8, 50.0)
        # a flood: at most the queue's bound waits, the rest is dropped and counted; honest ones still land
        data = [seal(SECRET, _raw(_add(f"flood-{i}", keys=[1000 + i])), now) for i in range(5000)]
        bad.call(lambda: _burst(bad, data))
        wait_until(lambda: b.count("queue_full") > 0, timeout=20)
        assert b.fanout._jobs.qsize() <= 64
        # every message accounted for: applied, dropped at the queue, or dropped by the NATS client's own bound
        seen = lambda: sum(b.count(k) for k in ("add", "unknown_worker", "queue_full", "bad")) + b.nats.errors  # noqa: E731
        wait_until(lambda: seen() >= 5008 and b.fanout._jobs.qsize() == 0, timeout=30)
        assert len(b.svc.routes.pending) < 5000
        _publish(bad, seal(SECRET, _raw(_add("after-flood", keys=[7, 8])), time.time()))
        wait_until(lambda: b.svc.routes.pending.get("default", "after-flood") is not None, timeout=30)
        score = b.svc.score("default", list(range(BS * 2)))
        assert [w.worker_id for w in score.workers] == ["w0"]
        assert "kvatlas_route_fanout_queued" in b.fanout.metrics_text()
    finally:
        bad.close()
        b.close()


async def _burst(nt: NatsThread, data: list[bytes]) -> None:
    for d in data:
        await nt.nc.publish(DEFAULT_ROUTES_SUBJECT, d)
    await nt.nc.flush()
