"""Shared worker registry in a NATS KV bucket: a registration on one replica is seen by all."""
from __future__ import annotations

import threading

from support.net import wait_until
from indexer.shared_registry import SharedRegistry
from schemas.api import RegisterWorker
from schemas.jetstream import kv_key, kv_key_name
from support.nats import NatsServer


def test_put_watch_delete_across_replicas() -> None:
    with NatsServer() as srv:
        a = SharedRegistry(srv.url, "reg")
        b = SharedRegistry(srv.url, "reg")
        seen: dict[str, RegisterWorker] = {}
        lock = threading.Lock()

        def on_put(reg: RegisterWorker) -> None:
            with lock:
                seen[reg.worker_id] = reg

        def on_delete(wid: str) -> None:
            with lock:
                seen.pop(wid, None)

        try:
            first = RegisterWorker(worker_id="w.0 x", endpoint="tcp://h:1", model="m", block_size=8)
            a.put(first)
            b.watch(on_put, on_delete)  # existing entries are replayed first
            wait_until(lambda: "w.0 x" in seen, timeout=30)
            a.put(RegisterWorker(worker_id="w1", endpoint="jetstream:kvatlas.events.m.w1"))
            wait_until(lambda: "w1" in seen, timeout=30)
            assert b.get("w.0 x") == first
            assert sorted(r.worker_id for r in b.list()) == ["w.0 x", "w1"]
            assert a.delete("w1") and not a.delete("nope")
            wait_until(lambda: "w1" not in seen, timeout=30)
            # A bad value is counted and skipped, never raised into the watcher.
            nt = a._nats
            nt.call(lambda: a._kv.put(kv_key("bad"), b"{not json"))
            wait_until(lambda: b.bad_values >= 1, timeout=30)
            assert b.get("bad") is None and [r.worker_id for r in b.list()] == ["w.0 x"]
        finally:
            a.close()
            b.close()
    assert kv_key_name(kv_key("a=b/ü")) == "a=b/ü"
