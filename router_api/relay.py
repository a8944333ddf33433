"""ZeroMQ publishers (vLLM, SGLang, kvatlas) bridged into JetStream (docs/jetstream.md).

The relay reads each engine with the indexer's own `indexer.subscriber.Subscriber` (gap replay,
restart detection) and writes one JetStream subject per worker, so the stream is complete:

- `Batch`  -> published with the engine's own seq as `Kvatlas-Seq` under the current epoch
             (`Nats-Msg-Id` makes a re-sent batch a no-op).
- `Restart` -> a new epoch (consumers read it as a restart and clear the worker); seqs follow
             the engine's again.
- `Gap(recovered=False)` -> nothing is invented: the missing seqs stay a hole under the same
             epoch, which every consumer reads as `Gap(recovered=False)` (clear + resync); the
             relay also asks the engine for a snapshot (kvatlas producers answer in-stream with
             AllBlocksCleared + full state; vLLM/SGLang ignore it).
- A snapshot request from an indexer (core NATS control subject) is forwarded to the engine.
- Relay restart: each worker resumes from the last message of its subject (same epoch, engine
  seq + 1): the engine's replay buffer fills the time the relay was down.

Workers are registered in the shared registry as `jetstream:<subject>` endpoints.
"""
from __future__ import annotations

import argparse
import logging
from typing import Any

import msgspec
from nats.js.errors import NotFoundError

from transport.natsio import NatsThread, ensure_stream
from indexer.shared_registry import SharedRegistry
from indexer.deliveries import Batch, Gap, Restart
from indexer.subscriber import Subscriber
from transport.jetstream_publisher import JetStreamEventPublisher, new_epoch
from schemas.api import RegisterWorker
from schemas.names import worker_id_problem
from schemas.jetstream import StreamSettings, event_subject, jetstream_endpoint, parse_headers

log = logging.getLogger(__name__)


class RelayWorker(msgspec.Struct, frozen=True):
    """One `--worker ID=ENDPOINT[,replay=ENDPOINT][,model=NAME][,block_size=N]`."""

    worker_id: str
    endpoint: str
    replay_endpoint: str | None = None
    model: str = "default"
    block_size: int = 16
    dp_rank: int = 0
    topic: str = ""


def parse_worker_spec(text: str) -> RelayWorker:
    """`ID=ENDPOINT[,replay=ENDPOINT][,model=NAME][,block_size=N][,dp_rank=N][,topic=T]` ->
    RelayWorker; `argparse.ArgumentTypeError` naming the problem otherwise."""
    head, *opts = text.split(",")
    wid, sep, endpoint = head.partition("=")
    if not sep or not wid or "://" not in endpoint:
        raise argparse.ArgumentTypeError(f"--worker expects ID=tcp://HOST:PORT[,key=value...], got {text!r}")
    problem = worker_id_problem(wid)  # the indexers' own rule: a worker they would refuse is never relayed
    if problem is not None:
        raise argparse.ArgumentTypeError(f"--worker {text!r}: {problem}")
    fields: dict[str, Any] = {"worker_id": wid, "endpoint": endpoint}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep or not value:
            raise argparse.ArgumentTypeError(f"--worker {wid}: option {opt!r} is not key=value")
        if key == "replay":
            if "://" not in value:
                raise argparse.ArgumentTypeError(f"--worker {wid}: replay endpoint {value!r} is not a URL")
            fields["replay_endpoint"] = value
        elif key in ("model", "topic"):
            fields[key] = value
        elif key in ("block_size", "dp_rank"):
            try:
                n = int(value)
            except ValueError:
                raise argparse.ArgumentTypeError(f"--worker {wid}: {key} {value!r} is not an integer") from None
            if n < (1 if key == "block_size" else 0):
                raise argparse.ArgumentTypeError(f"--worker {wid}: {key} {n} is out of range")
            fields[key] = n
        else:
            raise argparse.ArgumentTypeError(
                f"--worker {wid}: unknown option {key!r} (replay, model, block_size, dp_rank, topic)")
    return RelayWorker(**fields)


def registration(w: RelayWorker, prefix: str) -> RegisterWorker:
    """What the indexers see: the worker read from its JetStream subject."""
    return RegisterWorker(worker_id=w.worker_id, endpoint=jetstream_endpoint(w.model, w.worker_id, prefix),
                          model=w.model, block_size=w.block_size, dp_rank=w.dp_rank)


class RelayStats(msgspec.Struct):
    forwarded: int = 0
    restarts: int = 0
    gaps_recovered: int = 0
    gaps_unrecovered: int = 0
    snapshot_requests_forwarded: int = 0
    resumed_workers: int = 0


async def last_position(js: Any, stream: str, subject: str) -> tuple[str, int | None] | None:
    """(epoch, last whole seq) of the last kvatlas message on `subject`, or None. A split batch
    whose last part is missing (the relay stopped half-way) is not whole: it is sent again (its
    stored parts are duplicates by Nats-Msg-Id)."""
    try:
        msg = await js.get_last_msg(stream, subject, direct=True)
    except NotFoundError:
        return None
    hdrs = parse_headers(msg.headers)
    if isinstance(hdrs, str):
        return None
    if hdrs.part < hdrs.parts - 1:
        return hdrs.epoch, (hdrs.seq - 1 if hdrs.seq > 0 else None)
    return hdrs.epoch, hdrs.seq


class Relay:
    """Owns a ZeroMQ Subscriber and one JetStream publisher per worker. `step()` is the whole
    loop body (call it from one thread); `close()` flushes everything to JetStream."""

    __slots__ = ("_nats", "_own_nats", "settings", "sub", "pubs", "workers", "registry", "stats")

    def __init__(self, nats: str | NatsThread, workers: list[RelayWorker], *,
                 stream: StreamSettings | None = None, registry_bucket: str | None = None,
                 replay_timeout: float = 2.0, subscriber: Subscriber | None = None) -> None:
        ids = [w.worker_id for w in workers]
        if len(set(ids)) != len(ids):
            raise ValueError("a worker id is given twice")
        for wid in ids:
            problem = worker_id_problem(wid)
            if problem is not None:
                raise ValueError(problem)
        self.settings = stream or StreamSettings()
        self._own_nats = isinstance(nats, str)
        self._nats = NatsThread(nats, name="kvatlas-relay") if isinstance(nats, str) else nats
        self.sub = subscriber or Subscriber(replay_timeout=replay_timeout)
        self.pubs: dict[str, JetStreamEventPublisher] = {}
        self.workers = {w.worker_id: w for w in workers}
        self.registry: SharedRegistry | None = None
        self.stats = RelayStats()
        try:
            js = self._nats.js
            assert js is not None  # set by NatsThread's start, which the constructor ran
            self._nats.call(lambda: ensure_stream(js, self.settings))
            for w in workers:
                self._add(w)
            if registry_bucket is not None:
                self.registry = SharedRegistry(self._nats, registry_bucket)
                for w in workers:
                    self.registry.put(registration(w, self.settings.prefix))
        except Exception:
            self.close()
            raise

    def _add(self, w: RelayWorker) -> None:
        subject = event_subject(w.model, w.worker_id, self.settings.prefix)
        js = self._nats.js
        pos = self._nats.call(lambda: last_position(js, self.settings.name, subject))
        if pos is None:
            epoch, last = new_epoch(), None
        else:
            epoch, last = pos
            self.stats.resumed_workers += 1
            log.info("worker %s: resuming at engine seq %d (epoch %s)", w.worker_id,
                     0 if last is None else last + 1, epoch)
        self.pubs[w.worker_id] = JetStreamEventPublisher(
            self._nats, model=w.model, worker_id=w.worker_id, stream=self.settings, ensure=False,
            epoch=epoch, first_seq=0 if last is None else last + 1)
        self.sub.add(w.worker_id, w.endpoint, replay_endpoint=w.replay_endpoint, topic=w.topic, last_seq=last)

    def step(self, timeout_ms: int = 50) -> int:
        """Forward what the engines delivered within `timeout_ms`; returns deliveries handled."""
        deliveries = self.sub.poll(timeout_ms)
        for d in deliveries:
            pub = self.pubs[d.worker_id]
            if isinstance(d, Batch):
                try:
                    pub.publish_at(d.seq, d.payload)
                    self.stats.forwarded += 1
                except ValueError as exc:  # cannot happen with a sane Subscriber; never crash
                    log.error("worker %s: %s", d.worker_id, exc)
            elif isinstance(d, Restart):
                self.stats.restarts += 1
                log.warning("worker %s: engine restarted (seq %d -> %d): new epoch %s", d.worker_id,
                            d.old_seq, d.new_seq, pub.new_epoch())
            elif isinstance(d, Gap):
                if d.recovered:
                    self.stats.gaps_recovered += 1
                else:
                    self.stats.gaps_unrecovered += 1
                    log.warning("worker %s: engine batches %d..%d lost; consumers will resync",
                                d.worker_id, d.first, d.last)
                    self.sub.request_snapshot(d.worker_id)
        for wid, pub in self.pubs.items():
            if pub.snapshot_requested() and self.sub.request_snapshot(wid):
                self.stats.snapshot_requests_forwarded += 1
        return len(deliveries)

    def flush(self, timeout: float = 5.0) -> bool:
        return all([pub.flush(timeout) for pub in self.pubs.values()])

    def close(self, timeout: float = 5.0) -> None:
        for pub in self.pubs.values():
            pub.close(timeout)
        self.pubs.clear()
        self.sub.close()
        if self.registry is not None:
            self.registry.close()
        if self._own_nats:
            self._nats.close(timeout)
