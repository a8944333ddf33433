"""Operator basics: `kvatlas --version`; a worker whose block size conflicts with its model refused
with a clear error on every registration path (static --worker, POST /workers, embedded) and named
in /metrics; per-worker status and seconds-since-last-event gauges; `kvatlas worker`'s default block
size equal to the indexer's."""
from __future__ import annotations

import pytest

from producer.publisher import ZmqEventPublisher
from cli import main as cli
from cli.indexer import DEFAULTS, build_config
from router_api.embedded import EmbeddedIndexer
from router_api.registry import ConflictingBlockSize
from router_api.config import ServiceConfig
from support.net import free_port, wait_until
from support.service import LiveIndexer


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ex:
        cli.main(["--version"])
    assert ex.value.code == 0 and capsys.readouterr().out.startswith("kvatlas ")


def test_worker_default_block_size_is_the_indexers() -> None:
    args = cli.build_parser().parse_args(["worker"])
    assert args.block_size == DEFAULTS["block_size"]


def test_static_worker_with_conflicting_block_size_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    parse = cli.build_parser().parse_args
    args = parse(["indexer", "--block-size", "16", "--worker", "w9=tcp://127.0.0.1:5999,block_size=32"])
    with pytest.raises(ValueError, match=r"worker 'w9': block_size 32 conflicts with model 'default', which uses 16"):
        build_config(args)
    assert cli.main(["indexer", "--port", "0", "--worker", "w9=tcp://127.0.0.1:5999,block_size=32"]) == 2
    assert "conflicts with model 'default'" in capsys.readouterr().err
    # two static workers of another model that disagree
    args = parse(["indexer", "--worker", "a=tcp://127.0.0.1:5998,model=m,block_size=8",
                  "--worker", "b=tcp://127.0.0.1:5997,model=m,block_size=4"])
    with pytest.raises(ValueError, match="worker 'b': block_size 4 conflicts with model 'm', which uses 8"):
        build_config(args)


def test_http_and_embedded_refusals_and_worker_gauges() -> None:
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    try:
        cfg = ServiceConfig(port=free_port(), block_size=16, stale_after_s=600, remove_after_s=3600)
        with LiveIndexer(cfg) as idx:
            c = idx.client
            bad = c.post("/workers", json={"worker_id": "odd-one", "endpoint": "tcp://127.0.0.1:5996", "block_size": 32})
            assert bad.status_code == 409
            assert bad.json()["error"] == "block_size 32 conflicts with model 'default', which uses 16"
            assert c.post("/workers", json={"worker_id": "w0", "endpoint": pub.endpoint,
                                            "replay_endpoint": pub.replay_endpoint}).status_code == 201

            def live() -> bool:
                pub.heartbeat()
                return 'kvatlas_worker_status{status="live",worker="w0"} 1.0' in c.get("/metrics").text
            wait_until(live, timeout=15)
            text = c.get("/metrics").text
            assert 'kvatlas_registrations_refused_total{reason="block_size_conflict",worker="odd-one"} 1.0' in text
            assert 'kvatlas_worker_status{status="stale",worker="w0"} 0.0' in text
            silent = [ln for ln in text.splitlines() if ln.startswith('kvatlas_worker_seconds_since_last_event{worker="w0"}')]
            assert len(silent) == 1 and 0.0 <= float(silent[0].split()[-1]) < 600
    finally:
        pub.close()
    with EmbeddedIndexer([], block_size=16) as emb, pytest.raises(ConflictingBlockSize, match="conflicts"):
        emb.add_worker({"worker_id": "x", "endpoint": "tcp://127.0.0.1:5995", "block_size": 8})
