"""Hostile or absurd inputs at the edges (issue 24): u64 seqs past 2^63 in the sequencing ring,
absurd recorded timestamps in `kvatlas replay --publish`, worker names that the relay and the
indexer must judge alike, terminal escapes in the replay summary."""
from __future__ import annotations

import math
import time
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.eventlog import EventLogWriter
from indexer.replay import Pacer
from indexer.sequencing import FP_WINDOW, SeqTracker
from cli.main import main as cli_main
from schemas.events import KVEventBatch
from router_api.procs import spawn

U64 = (1 << 64) - 1


@settings(max_examples=60, deadline=None)
@given(start=st.integers(min_value=(1 << 63) - 2 * FP_WINDOW, max_value=U64 - 3 * FP_WINDOW),
       n=st.integers(min_value=1, max_value=3 * FP_WINDOW))
def test_seq_tracker_fingerprints_take_any_u64_seq(start: int, n: int) -> None:
    t = SeqTracker()
    for seq in range(start, start + n):
        t.remember(seq, seq.to_bytes(8, "big"))
        t.last = t.live_last = seq
    last = start + n - 1
    for seq in range(max(start, last - FP_WINDOW + 1), last + 1):  # still in the ring: a stale copy
        assert t.stale_copy(seq, seq.to_bytes(8, "big"))
        assert not t.stale_copy(seq, b"another payload")
    t.remember(U64, b"top")
    t.last = t.live_last = U64
    assert t.classify_live(0).action.name == "RESTART" and not t.stale_copy(0, b"top")


T0 = 1_700_000_000.0


@pytest.mark.parametrize("stamps", [
    [T0, math.inf, T0 + 0.1, T0 + 0.2],          # a frame at inf
    [T0, T0 + 1e18, T0 + 0.1, T0 + 0.2],          # one 1e18 s ahead
    [-1e18, T0, T0 + 0.1, T0 + 0.2],              # the first one at -1e18
    [T0, math.nan, -math.inf, T0 + 0.2],
], ids=["inf", "far_ahead", "far_behind_first", "nan_and_minus_inf"])
def test_replay_publish_paces_through_absurd_recv_ts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     stamps: list[float]) -> None:
    """`--speed 1.0` sends every frame, waits only for the sane steps (0.2 s here, not 1e18 s),
    and counts the jumps it did not wait for."""
    log = tmp_path / "absurd.kvlog"
    with EventLogWriter(log) as w:
        for seq, ts in enumerate(stamps):
            w.write(ts, "w0", 0, seq, msgspec.msgpack.encode(KVEventBatch(0.0, [], 0)))
    t = time.monotonic()
    assert cli_main(["replay", str(log), "--publish", "tcp://127.0.0.1:*", "--speed", "1.0", "--quiet"]) == 0
    assert time.monotonic() - t < 30.0  # it would wait ~1e18 s (or crash) otherwise
    out = capsys.readouterr().out
    assert "re-published 4 of 4 frames" in out and "timestamps not paced" in out, out


def test_pacer_waits_for_the_recorded_steps_only() -> None:
    p = Pacer(2.0, max_gap_s=10.0)
    assert p.delay(T0, 0.0) == 0.0
    assert p.delay(T0 + 1.0, 0.0) == 0.5  # one recorded second at twice the speed
    assert p.delay(T0 + 0.5, 0.5) == 0.0  # a step back (interleaved workers): no wait
    assert p.delay(T0 + 1e6, 0.5) == 0.0 and p.clamped == 1  # a jump: collapsed, a new baseline
    assert p.delay(T0 + 1e6 + 2.0, 0.5) == 1.0  # 3 recorded seconds in all, at 2x, 0.5 s gone
    assert p.delay(math.inf, 0.5) == 1.0 and p.clamped == 2  # paced as the frame before it


def test_replay_prints_recorded_worker_names_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hostile = "w\x1b[2J\nFAKE summary line"
    log = tmp_path / "names.kvlog"
    with EventLogWriter(log) as w:
        for seq in range(3):
            w.write(T0 + seq, hostile, 0, seq, msgspec.msgpack.encode(KVEventBatch(0.0, [], 0)))
    assert cli_main(["replay", str(log), "--apply", "--quiet"]) == 0
    assert cli_main(["replay", str(log), "--publish", "tcp://127.0.0.1:*", "--quiet"]) == 0
    cap = capsys.readouterr()
    text = cap.out + cap.err
    assert "\x1b" not in text and "\nFAKE" not in text, text
    assert "w\\x1b[2J\\nFAKE summary line" in text


@settings(max_examples=300, deadline=None)
@given(wid=st.text(min_size=1, max_size=40).filter(lambda t: "," not in t and "=" not in t))
def test_relay_and_indexer_judge_worker_ids_alike(wid: str) -> None:
    """One rule (schemas/names.py): the relay refuses exactly the ids every indexer would refuse,
    so it never forwards events of a worker no replica registers."""
    import argparse

    from router_api.registry import RegistryError, validate_worker_id
    from router_api.relay import parse_worker_spec

    try:
        validate_worker_id(wid)
        indexer_ok = True
    except RegistryError:
        indexer_ok = False
    try:
        parse_worker_spec(f"{wid}=tcp://127.0.0.1:5557")
        relay_ok = True
    except argparse.ArgumentTypeError:
        relay_ok = False
    assert relay_ok == indexer_ok, wid


def test_the_relay_refuses_the_ids_from_the_report() -> None:
    import argparse

    from router_api.relay import parse_worker_spec

    for wid in ("w 1", "a%2Eb", "w\n1", "a/b"):
        with pytest.raises(argparse.ArgumentTypeError, match="invalid worker_id"):
            parse_worker_spec(f"{wid}=tcp://127.0.0.1:5557")


def test_record_takes_seqs_at_and_above_2_63(tmp_path: Path) -> None:
    """`kvatlas record` behind a publisher counting from 2^63 + 250 records every batch with its
    u64 seq (it crashed in the fingerprint ring before)."""
    import os
    import signal
    import subprocess
    import sys

    import zmq

    from indexer.eventlog import read_event_log
    from schemas.frames import seq_bytes
    from support.net import REPO_ROOT

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    out = tmp_path / "u64.kvlog"
    proc = spawn([sys.executable, "-m", "cli.main", "record", "--connect",
                             f"w0=tcp://127.0.0.1:{port}", "--out", str(out), "--no-progress"], cwd=REPO_ROOT,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seq = (1 << 63) + 250
    empty = msgspec.msgpack.encode(KVEventBatch(0.0, [], 0))
    try:
        def recorded(n: int) -> bool:
            nonlocal seq
            assert proc.poll() is None, proc.communicate()
            pub.send_multipart([b"", seq_bytes(seq), empty])
            seq += 1
            frames = list(read_event_log(out)) if out.exists() and out.stat().st_size > 8 else []
            return len(frames) >= n
        from support.net import wait_until

        wait_until(lambda: recorded(300), timeout=30.0, interval=0.01)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        pub.close(0)
    assert proc.returncode == 0, err
    seqs = [f.seq for f in read_event_log(out)]
    assert seqs[0] >= 1 << 63 and seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs[:5]
    assert "Traceback" not in err, err
