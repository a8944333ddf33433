"""The service's snapshots: built from the index and the registry under the service's lock, saved to its
store, and restored at start (docs/service.md, "Snapshots"). Functions of the `IndexerService`, whose
methods of the same names call them."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from indexer.snapshot import (
    SNAPSHOT_VERSION,
    ModelSnapshot,
    Snapshot,
    SnapshotError,
    WorkerSnapshot,
    decode_snapshot,
    encode_snapshot,
)
from router_api.registry import RegistryError

if TYPE_CHECKING:
    from router_api.service import IndexerService

log = logging.getLogger("kvatlas.service")


def build_snapshot(svc: IndexerService) -> Snapshot:
    with svc.lock:  # index state and watermarks from the same instant (between two batches)
        models = [ModelSnapshot(m, bs, list(svc.index.dump(m))) for m, bs in svc.index.models().items()]
        workers = [WorkerSnapshot(w.reg, w.last_seq, sorted(w.dp_ranks), w.clean) for w in svc.registry]
    svc.generation += 1
    return Snapshot(SNAPSHOT_VERSION, svc.generation, time.time(), workers, models)


def snapshot_now(svc: IndexerService, only_if_changed: bool = False) -> bool:
    if svc.store is None:
        return False
    with svc._snap_lock:
        t0 = svc.clock()
        # Every state change comes through a delivered batch or a (un)registration.
        mark = (svc.ingest.deliveries, svc._membership)
        if only_if_changed and mark == svc._saved_mark:
            return False
        try:
            snap = build_snapshot(svc)
            data = encode_snapshot(snap)
            svc.store.save(data)
        except (SnapshotError, Exception) as exc:  # never let a snapshot failure kill the service
            svc.metrics.snapshots.inc("save_failed")
            log.error("event=snapshot_failed target=%s error=%s", svc.store.description, exc)
            return False
        svc._saved_mark = mark
        svc.metrics.snapshots.inc("saved")
        log.info("event=snapshot_saved generation=%d workers=%d bytes=%d ms=%.1f",
                 snap.generation, len(snap.workers), len(data), (svc.clock() - t0) * 1e3)
        return True


def load_snapshot_bytes(svc: IndexerService) -> bytes | None:
    """The stored snapshot (None: there is none). An unreachable store is retried for
    `snapshot_load_timeout_s`, then SnapshotError: starting empty would later overwrite the
    good snapshot with an emptier state (docs/service.md, "Snapshots")."""
    assert svc.store is not None
    deadline = svc.clock() + svc.config.snapshot_load_timeout_s
    delay = 0.05
    while True:
        try:
            return svc.store.load()
        except SnapshotError as exc:
            svc.metrics.snapshots.inc("load_failed")
            if svc.clock() >= deadline:
                raise SnapshotError(
                    f"{exc}; still unreadable after {svc.config.snapshot_load_timeout_s:g}s. Not "
                    "starting: an indexer started empty would overwrite that snapshot. Bring the "
                    "store back, or point --snapshot elsewhere to start empty on purpose") from exc
            log.warning("event=snapshot_load_retry target=%s error=%s", svc.store.description, exc)
            svc._snap_stop.wait(delay)  # back-off between attempts, not a synchronisation
            delay = min(delay * 2, 1.0)


def restore(svc: IndexerService) -> None:
    """Load the snapshot. A worker's watermark comes back only with its model's state; a
    worker whose model could not be loaded is registered with no watermark, so its stream is
    replayed from seq 0 (or resynced when the replay cannot cover it)."""
    if svc.store is None:
        return
    data = load_snapshot_bytes(svc)
    if data is None:
        log.info("event=snapshot_absent target=%s", svc.store.description)
        return
    try:
        snap = decode_snapshot(data)
    except SnapshotError as exc:
        svc.metrics.snapshots.inc("load_failed")
        raise SnapshotError(
            f"snapshot at {svc.store.description} cannot be read: {exc}. Not starting: it would be "
            "overwritten by an emptier state. Move it aside (or delete it) to start empty") from exc
    loaded: set[str] = set()
    for ms in snap.models:
        try:
            svc.index.ensure_model(ms.model, ms.block_size)
            svc.index.load_dump(ms.model, ms.block_size, list(ms.workers))
        except Exception as exc:
            svc.metrics.snapshots.inc("load_failed")
            log.error("event=snapshot_model_failed model=%s error=%r (its workers replay from seq 0)",
                      ms.model, exc)
            for wid in {w for w, _rank, _events in ms.workers}:  # drop whatever got in part-way
                try:
                    svc.index.clear_worker(ms.model, wid)
                except Exception:
                    pass
            continue
        loaded.add(ms.model)
    for ws in snap.workers:
        restored = ws.reg.model in loaded
        try:
            svc.register(ws.reg, last_seq=ws.last_seq if restored else None)
        except RegistryError as exc:
            log.error("event=snapshot_worker_rejected worker=%s error=%s", ws.reg.worker_id, exc)
            continue
        if not restored:
            svc.metrics.snapshots.inc("worker_not_restored")
            log.warning("event=snapshot_worker_not_restored worker=%s model=%s replay_from=0",
                        ws.reg.worker_id, ws.reg.model)
            continue
        w = svc.registry.get(ws.reg.worker_id)
        if w is not None:
            w.clean = ws.clean  # a loss not yet answered stays one across the restart
            for rank in ws.dp_ranks:
                svc.registry.add_rank(w, rank)
            for rank in ws.dp_ranks:
                svc.index.register_worker(ws.reg.model, ws.reg.worker_id, rank)
    for model in list(svc.index.models()):  # a snapshot's model whose workers all went
        svc._drop_model_if_unused(model)
    svc.generation = snap.generation
    svc.restored_from = snap.generation
    svc.metrics.snapshots.inc("loaded")
    log.info("event=snapshot_loaded generation=%d workers=%d models=%d models_failed=%d", snap.generation,
             len(snap.workers), len(snap.models), len(snap.models) - len(loaded))
