"""`kvatlas record` as a real subprocess against a live publisher: records byte-exact payloads,
fills gaps from replay, stops cleanly on SIGINT/SIGTERM/--duration, rejects bad arguments."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from indexer.eventlog import read_event_log
from producer.publisher import ZmqEventPublisher
from schemas.events import BlockStored, KVEventBatch
from router_api.procs import spawn

REPO = Path(__file__).resolve().parent.parent


def record_cmd(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return spawn([sys.executable, "-m", "cli.main", "record", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def frames_in(path: Path) -> list:
    if not path.exists() or path.stat().st_size < 8:
        return []
    return list(read_event_log(path))


def payload(i: int) -> bytes:
    ev = BlockStored([i * 2, i * 2 + 1], None, list(range(32)), 16, None, "CPU_PINNED")
    return msgspec.msgpack.encode(KVEventBatch(float(i), [ev], 3))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_records_live_publisher_until_signal(tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "run.kvlog"
    sent: list[bytes] = []
    with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") as pub:
        for i in range(50):  # published before the recorder exists: it must get them by replay
            sent.append(payload(i))
            pub.publish_payload(sent[-1])
        proc = record_cmd("--connect", f"w0={pub.endpoint}", "--replay", f"w0={pub.replay_endpoint}",
                          "--out", str(out))
        try:
            deadline = time.monotonic() + 30
            while True:  # keep publishing until the recorder has flushed something past seq 50
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "recorder never caught up"
                sent.append(payload(len(sent)))
                pub.publish_payload(sent[-1])
                frames = frames_in(out)
                if frames and frames[-1].seq >= 50:
                    break
                try:  # pace the publisher; a recorder that exits early fails the assert above
                    proc.wait(timeout=0.02)
                except subprocess.TimeoutExpired:
                    pass
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, err
    assert "recorded" in err
    reader = read_event_log(out)
    frames = list(reader)
    assert not reader.truncated
    assert [f.seq for f in frames] == list(range(len(frames))) and len(frames) > 50
    assert all(f.payload == sent[f.seq] for f in frames), "payload bytes exactly as sent"
    assert {f.worker for f in frames} == {"w0"} and {f.dp_rank for f in frames} == {3}
    assert all(f.recv_ts > 0 for f in frames)


def test_duration_stops_by_itself_with_progress(tmp_path: Path) -> None:
    out = tmp_path / "idle.kvlog"
    t = time.monotonic()
    proc = record_cmd("--connect", "w0=tcp://127.0.0.1:1", "--out", str(out), "--duration", "1.4")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert time.monotonic() - t >= 1.4
    assert "recording: 0 batches" in err and "recorded 0 batches" in err
    reader = read_event_log(out)
    assert list(reader) == [] and not reader.truncated


@pytest.mark.parametrize("args, message", [
    (["--connect", "nonsense", "--out", "x"], "ID=tcp://HOST:PORT"),
    (["--connect", "a=tcp://127.0.0.1:1", "--replay", "b=tcp://127.0.0.1:2", "--out", "x"], "unknown worker"),
    (["--connect", "a=tcp://127.0.0.1:1", "--connect", "a=tcp://127.0.0.1:2", "--out", "x"], "twice"),
    (["--connect", "a=tcp://127.0.0.1:1", "--out", "x", "--duration", "-1"], "--duration"),
    (["--connect", "a=tcp://127.0.0.1:1", "--out", "/nonexistent-dir/x.kvlog"], "cannot write"),
])
def test_bad_arguments_exit_2_with_a_message(tmp_path: Path, args: list[str], message: str) -> None:
    proc = record_cmd(*args)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert message in err


def test_transport_modules_do_not_import_torch_or_fastapi() -> None:
    code = ("import sys, cli.main, cli.record, indexer.subscriber, indexer.eventlog, "
            "indexer.sequencing, producer.publisher; "
            "bad = [m for m in ('torch', 'fastapi', 'uvicorn') if m in sys.modules]; "
            "assert not bad, bad")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr


def test_shared_redis_fixture_is_a_real_private_server(redis_server) -> None:
    import redis

    client = redis.Redis.from_url(redis_server.url)
    assert client.ping() and client.dbsize() == 0
    client.set("k", b"v")
    assert client.get("k") == b"v"
    assert client.config_get("save")["save"] == "" and client.config_get("appendonly")["appendonly"] == "no"
    client.close()
