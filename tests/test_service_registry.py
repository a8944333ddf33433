"""Pure parts of the service: registration checks, the Prometheus exposition, and the CLI's config
parsing (the liveness state machine is tests/test_reconcile.py's)."""
from __future__ import annotations

import argparse
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cli.indexer import add_arguments, build_config, parse_tier_weights, parse_worker_spec
from router_api.metrics import Counter, Histogram, ServiceMetrics
from router_api.registry import (
    ConflictingBlockSize,
    DuplicateWorker,
    InvalidRegistration,
    Registry,
    UnknownWorker,
    validate_endpoint,
    validate_url,
)
from schemas.api import RegisterWorker


def _reg(wid: str, port: int = 5000, **kw: object) -> RegisterWorker:
    return RegisterWorker(worker_id=wid, endpoint=f"tcp://127.0.0.1:{port}", **kw)  # type: ignore[arg-type]


def test_registration_errors() -> None:
    r = Registry()
    r.add(_reg("a", 1), now=0)
    with pytest.raises(DuplicateWorker):
        r.add(_reg("a", 2), now=0)
    with pytest.raises(DuplicateWorker):
        r.add(_reg("b", 1), now=0)  # same endpoint and topic
    r.add(_reg("b", 1, topic="other"), now=0)  # same PUB, another topic: fine
    with pytest.raises(ConflictingBlockSize, match="conflicts"):
        r.add(_reg("c", 3, block_size=32), now=0)
    with pytest.raises(ConflictingBlockSize, match="conflicts"):
        Registry().add(_reg("c", 3, model="m", block_size=32), now=0, model_block_sizes={"m": 16})
    with pytest.raises(InvalidRegistration, match="replay_endpoint must differ"):
        r.add(RegisterWorker("d", "tcp://127.0.0.1:9", replay_endpoint="tcp://localhost:9"), now=0)
    with pytest.raises(UnknownWorker):
        r.remove("zzz")
    assert [w.worker_id for w in r] == ["a", "b"] and r.watermarks() == {}


@given(st.text(max_size=40))
@settings(max_examples=200, deadline=None)
def test_endpoint_validation_never_crashes(text: str) -> None:
    try:
        validate_endpoint(text)
    except InvalidRegistration as exc:
        assert text[:10] in str(exc) or "port" in str(exc)
    else:
        assert text.startswith(("tcp://", "ipc://", "inproc://"))


@given(st.text(max_size=40))
@settings(max_examples=200, deadline=None)
def test_url_validation_never_crashes(text: str) -> None:
    try:
        validate_url(text)
    except InvalidRegistration as exc:
        assert "invalid url" in str(exc)
    else:
        assert text.startswith(("http://", "https://")) and text.isascii() and text.isprintable()


def test_worker_url_is_validated_and_optional() -> None:
    r = Registry()
    assert r.add(_reg("a", 1), now=0).reg.url is None  # optional: engines registered without one
    assert r.add(_reg("b", 2, url="http://10.0.0.7:8000/v1"), now=0).reg.url == "http://10.0.0.7:8000/v1"
    r.add(_reg("c", 3, url="https://[::1]:8443"), now=0)
    for bad in ("tcp://127.0.0.1:1", "http://", "http://h:0", "http://h:70000", "http://h:1/a b", "ftp://h"):
        with pytest.raises(InvalidRegistration, match="invalid url"):
            r.add(_reg("d", 4, url=bad), now=0)
    assert "d" not in r


def test_prometheus_exposition() -> None:
    c = Counter("x_total", "help", ("reason",))
    c.inc('quo"te\n')
    c.inc("a", amount=2)
    h = Histogram("lat_seconds", "latency", ("endpoint",), (0.001, 0.01))
    h.observe(0.0005, "score")
    h.observe(0.005, "score")
    h.observe(5, "score")
    text = "\n".join(c.render() + h.render())
    assert 'x_total{reason="a"} 2' in text and 'x_total{reason="quo\\"te\\n"} 1' in text
    assert 'lat_seconds_bucket{endpoint="score",le="0.001"} 1' in text
    assert 'lat_seconds_bucket{endpoint="score",le="0.01"} 2' in text
    assert 'lat_seconds_bucket{endpoint="score",le="+Inf"} 3' in text
    assert 'lat_seconds_count{endpoint="score"} 3' in text
    with pytest.raises(ValueError):
        c.inc()
    assert "# TYPE kvatlas_drops_total counter" in ServiceMetrics().render()


def test_cli_config(tmp_path) -> None:
    assert parse_worker_spec("w1=tcp://h:1,replay=tcp://h:2,dp=3") == {
        "worker_id": "w1", "endpoint": "tcp://h:1", "replay_endpoint": "tcp://h:2", "dp_rank": 3}
    with pytest.raises(ValueError, match="unknown option"):
        parse_worker_spec("w1=tcp://h:1,colour=red")
    assert parse_tier_weights("gpu=1,host=0.5") == {"gpu": 1.0, "host": 0.5}
    cfg_file = tmp_path / "indexer.json"
    cfg_file.write_text(json.dumps({"port": 9999, "block_size": 32, "stale_after": 3,
                                    "workers": [{"worker_id": "f1", "endpoint": "tcp://h:7"}]}))
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = build_config(p.parse_args(["--config", str(cfg_file), "--port", "1234", "--worker", "w2=tcp://h:8"]))
    assert cfg.port == 1234 and cfg.block_size == 32 and cfg.stale_after_s == 3 and cfg.host == "127.0.0.1"
    assert [(w.worker_id, w.block_size) for w in cfg.static_workers] == [("w2", 32), ("f1", 32)]
    with pytest.raises(ValueError, match="unknown tier weight"):
        build_config(p.parse_args(["--tier-weights", "gpu=1,vram=2"]))
