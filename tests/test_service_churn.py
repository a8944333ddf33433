"""Registration churn leaves nothing behind (issue 24): a model whose last worker left is dropped
(its block size with it, also across a snapshot restart), the number of models is capped, and a
removed worker's per-worker metric series go with it."""
from __future__ import annotations

from pathlib import Path

from producer.publisher import ZmqEventPublisher
from router_api.config import ServiceConfig
from schemas.events import BlockStored
from support.net import free_port, wait_until
from support.service import LiveIndexer


def _reg(live: LiveIndexer, wid: str, model: str, block_size: int, port: int | None = None) -> int:
    body = {"worker_id": wid, "endpoint": f"tcp://127.0.0.1:{port or free_port()}", "model": model,
            "block_size": block_size}
    return live.client.post("/workers", json=body).status_code


def test_a_model_without_workers_is_dropped_with_its_block_size(tmp_path: Path) -> None:
    snap = f"file://{tmp_path / 'kv.snap'}"
    cfg = ServiceConfig(port=free_port(), block_size=4, snapshot_target=snap, max_models=3)
    with LiveIndexer(cfg) as live:
        assert _reg(live, "a", "llama", 1) == 201
        assert live.client.get("/health").json()["models"] == {"default": 4, "llama": 1}
        assert live.client.delete("/workers/a").status_code == 200
        assert live.client.get("/health").json()["models"] == {"default": 4}
        assert live.client.post("/score", json={"model": "llama", "token_ids": [1, 2]}).status_code == 404
        assert _reg(live, "b", "llama", 16) == 201  # the block size is no longer locked at 1
        # The cap counts models at once: default + llama + one more; a fourth waits for one to go.
        assert _reg(live, "c", "m2", 8) == 201
        assert _reg(live, "d", "m3", 8) == 503
        assert _reg(live, "c2", "m2", 8) == 201  # a known model is no new model
        assert live.client.delete("/workers/c").status_code == 200
        assert _reg(live, "d", "m3", 8) == 503  # m2 still has c2
        assert live.client.delete("/workers/c2").status_code == 200
        assert _reg(live, "d", "m3", 8) == 201
        assert live.client.delete("/workers/b").status_code == 200
    # Restarted from the final snapshot: only models with workers come back.
    cfg2 = ServiceConfig(port=free_port(), block_size=4, snapshot_target=snap, max_models=3)
    with LiveIndexer(cfg2) as live:
        models = live.client.get("/health").json()["models"]
        assert models == {"default": 4, "m3": 8}, models
        assert _reg(live, "e", "llama", 2) == 201


def test_a_removed_workers_metric_series_go_with_it() -> None:
    cfg = ServiceConfig(port=free_port(), block_size=4)
    pubs = [ZmqEventPublisher("tcp://127.0.0.1:*") for _ in range(3)]
    try:
        with LiveIndexer(cfg) as live:
            for i, pub in enumerate(pubs):
                body = {"worker_id": f"churn{i}", "endpoint": pub.endpoint, "block_size": 4}
                assert live.client.post("/workers", json=body).status_code == 201
            for i, pub in enumerate(pubs):
                def seen(i: int = i, pub: ZmqEventPublisher = pub) -> bool:
                    pub.publish([BlockStored([100 + i], None, [1, 2, 3, 4], 4)])
                    return f'worker="churn{i}"' in live.client.get("/metrics").text
                wait_until(seen, timeout=15.0, interval=0.05)
            for i in range(3):
                assert live.client.delete(f"/workers/churn{i}").status_code == 200
            text = live.client.get("/metrics").text
            assert "churn" not in text, [ln for ln in text.splitlines() if "churn" in ln]
            # An id used again starts from zero.
            assert live.client.post("/workers", json={"worker_id": "churn0", "endpoint": pubs[0].endpoint,
                                                      "block_size": 4}).status_code == 201
            assert 'kvatlas_batches_total{kind="live",worker="churn0"}' not in live.client.get("/metrics").text
    finally:
        for pub in pubs:
            pub.close()
