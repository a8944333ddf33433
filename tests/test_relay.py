"""`kvatlas relay`: ZeroMQ engines bridged into JetStream; replicas reading the stream stay exact
through an engine restart, a relay restart, and a loss beyond the engine's replay buffer."""
from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator

import pytest

from support.net import REPO_ROOT, free_port, wait_until
from support.reference import ReferenceIndex
from router_api.relay import Relay, RelayWorker, parse_worker_spec
from indexer.deliveries import Gap
from indexer.shared_registry import SharedRegistry
from indexer.subscriber import Subscriber
from support.jetstream import MODEL, Replica, scores, subject_last_seq
from producer.publisher import ZmqEventPublisher
from schemas.api import RegisterWorker
from schemas.events import KVEventBatch
from schemas.jetstream import jetstream_endpoint
from support.nats import NatsServer
from support.service import WorkerSim, make_prompts
from router_api.procs import spawn

BS = 4


def _engine(buffer_steps: int = 1000, ports: tuple[int, int] | None = None) -> ZmqEventPublisher:
    p, rp = ports or (free_port(), free_port())
    return ZmqEventPublisher(f"tcp://127.0.0.1:{p}", replay_endpoint=f"tcp://127.0.0.1:{rp}",
                             buffer_steps=buffer_steps)


def _ports(pub: ZmqEventPublisher) -> tuple[int, int]:
    assert pub.replay_endpoint is not None
    return int(pub.endpoint.rsplit(":", 1)[1]), int(pub.replay_endpoint.rsplit(":", 1)[1])


def _step(engine: ZmqEventPublisher, sim: WorkerSim, ref: ReferenceIndex, n: int) -> None:
    for _ in range(n):
        ev = sim.step()
        engine.publish(ev)
        ref.apply(MODEL, "w0", 0, KVEventBatch(0.0, ev))
    assert engine.flush(5.0)


def _settle(relay: Relay, replica: Replica, engine: ZmqEventPublisher) -> None:
    """Relay and replica pump until the replica has taken the last message the relay stored for
    the engine's last batch."""
    target = engine.next_seq - 1

    def relayed() -> bool:
        relay.step(10)
        replica.pump(0)
        return relay.sub.watermark("w0") == target and relay.flush(5.0)
    wait_until(relayed, timeout=20.0, interval=0.0)
    last = subject_last_seq(relay.pubs["w0"])

    def applied() -> bool:
        replica.pump(10)
        return (replica.sub.watermark("w0") or 0) >= last
    wait_until(applied, timeout=20.0, interval=0.0)


def _connected(relay: Relay, engine: ZmqEventPublisher) -> None:
    """ZeroMQ slow joiner: heartbeat until the relay sees the engine."""
    def seen() -> bool:
        engine.heartbeat()
        engine.flush(1.0)
        relay.step(20)
        return relay.sub.watermark("w0") is not None
    wait_until(seen, timeout=10.0, interval=0.0)


def test_worker_spec_parsing() -> None:
    w = parse_worker_spec("w0=tcp://h:1,replay=tcp://h:2,model=llama,block_size=32")
    assert w == RelayWorker("w0", "tcp://h:1", "tcp://h:2", "llama", 32)
    for bad in ["w0", "w0=h:1", "w0=tcp://h:1,block_size=x", "w0=tcp://h:1,color=red", "w0=tcp://h:1,replay"]:
        with pytest.raises(argparse.ArgumentTypeError):
            parse_worker_spec(bad)


def test_relay_survives_engine_restart_relay_restart_and_loss_beyond_the_buffer(nats: NatsServer) -> None:
    drop: set[int] = set()
    engine = _engine(buffer_steps=64)
    w = RelayWorker("w0", engine.endpoint, engine.replay_endpoint, MODEL, BS)
    relay = Relay(nats.url, [w], registry_bucket="workers", replay_timeout=1.0,
                  subscriber=Subscriber(replay_timeout=1.0, drop_live=lambda _w, s: s in drop))
    replica = Replica(nats.url, BS)
    sim = WorkerSim(1, BS, make_prompts(3, BS))
    ref = ReferenceIndex()
    ref.ensure_model(MODEL, BS)
    try:
        # Registered in the shared registry as a JetStream worker.
        reg = SharedRegistry(nats.url, "workers")
        assert reg.list() == [RegisterWorker(worker_id="w0", endpoint=jetstream_endpoint(MODEL, "w0"),
                                             model=MODEL, block_size=BS)]
        reg.close()
        _connected(relay, engine)
        replica.add("w0")
        _step(engine, sim, ref, 30)
        _settle(relay, replica, engine)
        queries = sim.sample_queries(30)
        assert scores(replica.index, queries) == scores(ref, queries)

        # Relay restart: the engine keeps publishing (within its buffer) while the relay is down.
        relay.close()
        _step(engine, sim, ref, 3)
        relay = Relay(nats.url, [w], registry_bucket="workers", replay_timeout=1.0)
        assert relay.stats.resumed_workers == 1
        _connected(relay, engine)
        _step(engine, sim, ref, 5)
        _settle(relay, replica, engine)
        assert "Gap" not in replica.kinds() and "Restart" not in replica.kinds()
        assert scores(replica.index, queries) == scores(ref, queries)

        # Engine restart: same endpoints, seq from 0, empty cache.
        ports = _ports(engine)
        engine.close()
        engine = _engine(buffer_steps=64, ports=ports)
        sim.clear()
        ref.clear_worker(MODEL, "w0")
        wait_until(lambda: (engine.heartbeat(), engine.flush(1.0), relay.step(20), relay.stats.restarts)[-1],
                   timeout=10.0, interval=0.0)
        _step(engine, sim, ref, 20)
        _settle(relay, replica, engine)
        assert replica.kinds().count("Restart") == 1 and relay.stats.restarts == 1
        queries = sim.sample_queries(30)
        assert scores(replica.index, queries) == scores(ref, queries)

        # Loss beyond the engine's 64-batch buffer: relay and replica both see an unrecovered gap;
        # the relay asks the engine for a snapshot.
        relay.close()
        relay = Relay(nats.url, [w], registry_bucket="workers", replay_timeout=1.0,
                      subscriber=Subscriber(replay_timeout=1.0, drop_live=lambda _w, s: s in drop))
        start = engine.next_seq
        drop.update(range(start, start + 80))
        _step(engine, sim, ref, 80)
        _connected(relay, engine)  # heartbeats after the loss reveal it
        _settle(relay, replica, engine)
        assert relay.stats.gaps_unrecovered == 1
        gaps = [d for d in replica.log if isinstance(d, Gap)]
        assert len(gaps) == 1 and not gaps[0].recovered
        wait_until(engine.snapshot_requested, timeout=30.0)
        # The worker rebuilds from what follows: a reset (what a snapshot answer starts with).
        sim.clear()
        from schemas.events import AllBlocksCleared
        engine.publish([AllBlocksCleared()])
        ref.clear_worker(MODEL, "w0")
        _step(engine, sim, ref, 15)
        _settle(relay, replica, engine)
        queries = sim.sample_queries(30)
        assert scores(replica.index, queries) == scores(ref, queries)
    finally:
        replica.close()
        relay.close()
        engine.close()


def test_relay_cli_runs_and_registers(nats: NatsServer, tmp_path) -> None:  # noqa: ANN001
    engine = _engine()
    proc = spawn(
        [sys.executable, "-m", "cli.relay", "--nats", nats.url, "--duration", "30",
         "--worker", f"w0={engine.endpoint},replay={engine.replay_endpoint},model=m1,block_size=8"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        reg = SharedRegistry(nats.url)
        wait_until(lambda: reg.get("w0") is not None, timeout=20.0, interval=0.02)
        got = reg.get("w0")
        assert got is not None and got.model == "m1" and got.block_size == 8
        assert got.endpoint == jetstream_endpoint("m1", "w0")
        reg.close()
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
        engine.close()
    assert proc.returncode == 0, out.decode()
    bad = subprocess.run([sys.executable, "-m", "cli.relay", "--nats", nats.url,
                          "--worker", "nonsense"], cwd=REPO_ROOT, capture_output=True)
    assert bad.returncode == 2 and b"--worker expects" in bad.stderr
