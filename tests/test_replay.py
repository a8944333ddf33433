"""`kvatlas replay`: a log recorded (by the real `kvatlas record` subprocess) from real publishers,
applied offline, ends in exactly the state the live indexer service reached from the same stream;
truncated tails, query files answered at recorded times, byte-identical re-publishing over real
ZMQ sockets, recorded pacing, and clear exit-2 errors for bad input."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from support.net import free_port, wait_until
from indexer.eventlog import EventLogWriter, read_event_log
from indexer.index import KVIndex
from indexer.replay import (
    LogReplayer, QueryFileError, frame_nbytes, pace_delay, parse_queries, plan_publishers, republish_steps,
    resolve_query_times,
)
from indexer.deliveries import Batch, Gap
from indexer.subscriber import Subscriber
from producer.publisher import ZmqEventPublisher
from cli.main import main as cli_main
from router_api.config import ServiceConfig
from router_api.service import IndexerService
from schemas.api import RegisterWorker
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, BlockStoredArr, KVEventBatch
from support.service import WorkerSim, make_prompts
from router_api.procs import spawn

REPO = Path(__file__).resolve().parent.parent
BS = 4
T0 = 1_700_000_000.0  # an epoch recv_ts for hand-written logs

pytestmark = pytest.mark.timeout(60)


def kvatlas(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return spawn([sys.executable, "-m", "cli.main", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def payload(events: list, dp_rank: int | None = 0, ts: float = 0.0) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(ts, events, dp_rank))


def store(hashes: list[int], parent: int | None, first_token: int, medium: str = "GPU") -> BlockStored:
    return BlockStored(hashes, parent, list(range(first_token, first_token + BS * len(hashes))), BS, None, medium)


# --- record -> replay --apply == live ---------------------------------------------------------------

def log_marks(path: Path) -> dict[str, int]:
    """Last recorded seq per worker (the recorder flushes after every poll)."""
    if not path.exists() or path.stat().st_size <= 8:
        return {}
    return {f.worker: f.seq for f in read_event_log(path)}


def test_record_then_apply_equals_the_live_index(tmp_path: Path) -> None:
    out = tmp_path / "run.kvlog"
    prompts = make_prompts(7, BS)
    sims = {f"w{i}": WorkerSim(100 + i, BS, prompts) for i in range(3)}
    ranks = {"w0": None, "w1": 0, "w2": 1}  # w0's batches carry no dp_rank, w2's carry rank 1
    pubs = {wid: ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") for wid in sims}
    service = IndexerService(ServiceConfig(block_size=BS, poll_ms=5, replay_timeout_s=5.0))
    service.start()
    recorder = None
    try:
        for wid, pub in pubs.items():
            service.register(RegisterWorker(worker_id=wid, endpoint=pub.endpoint,
                                            replay_endpoint=pub.replay_endpoint, block_size=BS))
        connect = [a for wid, p in pubs.items()
                   for a in ("--connect", f"{wid}={p.endpoint}", "--replay", f"{wid}={p.replay_endpoint}")]
        recorder = kvatlas("record", *connect, "--out", str(out), "--no-progress")
        rng = random.Random(3)

        def run(steps: int) -> None:
            order = [wid for wid in sims for _ in range(steps)]
            rng.shuffle(order)
            for wid in order:
                pubs[wid].publish(sims[wid].step(), ranks[wid])

        def settle() -> None:
            """Heartbeat (paced) until the live service and the recorder both hold every batch."""
            def done() -> bool:
                assert recorder is not None and recorder.poll() is None, recorder.communicate()
                for p in pubs.values():
                    p.flush(5)
                marks = {wid: p.next_seq - 1 for wid, p in pubs.items()}
                live = {wid: service.registry.get(wid).last_seq for wid in pubs}
                logged = log_marks(out)
                if live == marks and logged == marks:
                    return True
                for wid, p in pubs.items():
                    if live[wid] != marks[wid] or logged.get(wid) != marks[wid]:
                        p.heartbeat(ranks[wid])  # a subscriber joining late learns of the past by it
                return False
            wait_until(done, timeout=30, interval=0.05)

        run(40)
        settle()
        # w1 restarts: its engine comes back empty and its seqs start from 0 again.
        ep, rep = pubs["w1"].endpoint, pubs["w1"].replay_endpoint
        pubs["w1"].close()
        sims["w1"].clear()
        pubs["w1"] = ZmqEventPublisher(ep, replay_endpoint=rep)
        run(6)
        settle()
        recorder.send_signal(signal.SIGINT)
        _, err = recorder.communicate(timeout=20)
        assert recorder.returncode == 0, err
        assert service.registry.get("w1").restarts == 1
    finally:
        if recorder is not None and recorder.poll() is None:
            recorder.kill()
            recorder.communicate()
        for p in pubs.values():
            p.close()
        service.stop(final_snapshot=False)

    live = service.index
    queries = [q for sim in sims.values() for q in sim.sample_queries(6)]

    # In process: the same stats and scores, exactly.
    reader = read_event_log(out)
    replayer = LogReplayer(KVIndex(), "default", BS)
    for frame in reader:
        replayer.apply_frame(frame)
    assert not reader.truncated
    offline = replayer.index
    assert offline.worker_stats("default") == live.worker_stats("default")
    assert sum(t["gpu"] + t["host"] for t in offline.worker_stats("default").values()) > 20
    hits = 0
    for q in queries:
        got, want = offline.score("default", q), live.score("default", q)
        assert got == want, q
        hits += any(w.cached_blocks for w in got.workers)
        # ... and both are the true state of the simulated caches.
        by_worker = {(w.worker_id, w.dp_rank): w for w in got.workers}
        for wid, sim in sims.items():
            exp = sim.expect(q)
            ws = by_worker[(wid, ranks[wid] or 0)]
            assert (ws.device_blocks, ws.cached_blocks, ws.tiers) == (
                exp["device_blocks"], exp["cached_blocks"], exp["tiers"]), (wid, q)
    assert hits >= len(queries) // 2, "queries must exercise cached prefixes"
    w1 = replayer.workers["w1"].stream
    assert (w1.restarts, w1.gaps) == (1, 0)
    assert replayer.workers["w0"].stream.restarts == 0

    # Through the CLI: summary JSON and answers at the end of the log agree with the live index.
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps({"t": 1e6, "token_ids": q, "id": i}) + "\n" for i, q in enumerate(queries)))
    proc = kvatlas("replay", str(out), "--apply", "--queries", str(qfile), "--answers", str(tmp_path / "a.jsonl"),
                   "--out", str(tmp_path / "summary.json"))
    stdout, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "restarts 1" in stdout and "frames/s" in stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["block_size"] == BS and summary["restarts"] == 1 and summary["gaps"] == 0
    assert summary["frames"] == sum(1 for _ in read_event_log(out))
    assert summary["events"]["BlockStored"] > 0 and summary["events"]["BlockRemoved"] > 0
    assert {(w["worker_id"], int(r)): tiers for w in summary["workers"] for r, tiers in w["blocks"].items()} \
        == live.worker_stats("default")
    answers = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [a["id"] for a in answers] == list(range(len(queries)))
    for a, q in zip(answers, queries):
        assert a["frames_applied"] == summary["frames"]
        assert a["workers"] == msgspec.to_builtins(live.score("default", q).workers)


# --- truncated tail, progress -----------------------------------------------------------------------

def write_chain_log(path: Path, n: int, *, worker: str = "w0", ts: float = T0, step: float = 1.0) -> list[bytes]:
    """`n` frames, frame i stores block i (chained) on the GPU. Returns the payloads."""
    sent = []
    with EventLogWriter(path) as w:
        for i in range(n):
            sent.append(payload([store([1000 + i], 1000 + i - 1 if i else None, i * BS)], 0, ts + i * step))
            w.write(ts + i * step, worker, 0, i, sent[-1])
    return sent


def test_truncated_tail_replays_what_is_complete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "cut.kvlog"
    write_chain_log(log, 300)
    data = log.read_bytes()
    (tmp_path / "whole.kvlog").write_bytes(data)
    log.write_bytes(data[:-7])  # the recorder died inside the last frame
    assert cli_main(["replay", str(log), "--apply", "--out", str(tmp_path / "s.json"), "--progress"]) == 0
    cap = capsys.readouterr()
    assert "truncated" in cap.err and "299 complete frames" in cap.err
    assert "replay [" in cap.err and "frames/s" in cap.err  # the progress bar, forced on
    assert "WARNING: the log ends in a truncated frame" in cap.out
    s = json.loads((tmp_path / "s.json").read_text())
    assert (s["frames"], s["truncated"], s["block_size"]) == (299, True, BS)
    assert s["workers"][0]["blocks"]["0"]["gpu"] == 299
    assert s["bytes"] == len(data) - frame_nbytes(list(read_event_log(tmp_path / "whole.kvlog"))[-1])

    assert cli_main(["replay", str(tmp_path / "whole.kvlog"), "--apply", "--out", str(tmp_path / "w.json"),
                     "--quiet"]) == 0
    cap = capsys.readouterr()
    assert "truncated" not in cap.err and "replay [" not in cap.err
    w = json.loads((tmp_path / "w.json").read_text())
    assert (w["frames"], w["truncated"], w["bytes"]) == (300, False, len(data))
    assert w["workers"][0]["blocks"]["0"]["gpu"] == 300


def test_frame_sizes_add_up_to_the_file(tmp_path: Path) -> None:
    log = tmp_path / "sizes.kvlog"
    rng = random.Random(1)
    with EventLogWriter(log) as w:
        for i in range(200):
            worker = "w" * rng.choice([1, 31, 32, 255, 256, 70_000])
            dp = rng.choice([None, 0, 127, 128, 255, 256, 65535, 65536, 2**32, -1, -33, -129, -40_000, -2**33])
            seq = rng.choice([0, 127, 128, 300, 70_000, 2**32 + 5, 2**64 - 1])
            body = bytes(rng.choice([0, 10, 255, 256, 65535, 65536, 70_000]))
            w.write(T0 + rng.random(), worker, dp, seq, body)
    assert sum(frame_nbytes(f) for f in read_event_log(log)) == log.stat().st_size - 8


# --- gaps and restarts in a log -----------------------------------------------------------------------

def test_gaps_and_restarts_in_the_log_clear_the_worker(tmp_path: Path) -> None:
    log = tmp_path / "holes.kvlog"
    with EventLogWriter(log) as w:
        w.write(T0, "a", 0, 0, payload([store([1, 2], None, 0)]))
        w.write(T0, "b", 0, 0, payload([store([1, 2], None, 0)]))
        w.write(T0 + 1, "a", 0, 1, payload([store([3], 2, 2 * BS)]))
        w.write(T0 + 2, "a", 0, 5, payload([store([9], None, 100)]))  # seqs 2..4 lost: resync
        w.write(T0 + 2, "b", 0, 0, payload([store([7], None, 200)]))  # b restarted
        w.write(T0 + 3, "b", 0, 1, b"\x93not msgpack")  # counted, not applied, seq still advances
        w.write(T0 + 4, "b", 0, 2, payload([]))  # heartbeat
    replayer = LogReplayer(KVIndex(), "m", BS)
    for f in read_event_log(log):
        replayer.apply_frame(f)
    stats = replayer.index.worker_stats("m")
    assert stats[("a", 0)]["gpu"] == 1 and stats[("b", 0)]["gpu"] == 1  # only what followed the clear
    a, b = replayer.workers["a"].stream, replayer.workers["b"].stream
    assert (a.gaps, a.missing, a.resyncs, a.restarts) == (1, 3, 1, 0)
    assert (b.gaps, b.restarts, b.batches, b.heartbeats) == (0, 1, 3, 1)  # the bad payload is no batch
    assert sum(replayer.drops.values()) == 1 and all(k.startswith("decode_") for k in replayer.drops)
    s = replayer.summary(log_path=str(log), nbytes=0, truncated=False, corrupt_frames=0, queries=0, elapsed_s=1)
    assert (s.gaps, s.restarts, s.resyncs) == (1, 1, 1)


def test_clear_event_makes_a_resynced_stream_clean_again() -> None:
    """Expired orphans clear the worker once (first loss); after AllBlocksCleared, again."""
    idx = KVIndex(orphan_grace_batches=1)
    r = LogReplayer(idx, "m", BS)
    frames = [
        store([1], None, 0),
        store([50], 49, 10),  # orphan: parent 49 never arrives
        store([2], 1, BS),  # the orphan expires here -> clear (first loss of a clean stream)
        store([3], 2, 2 * BS),  # its parent went with the clear: an orphan again (the echo of the loss)
        store([4], None, 300),
        store([60], 59, 400),
        store([5], 4, 300 + BS),  # an orphan expires again: not clean -> no second clear
        AllBlocksCleared(),  # the worker's own reset: our view is complete again
        store([6], None, 500),
        store([70], 69, 600),
        store([7], 6, 500 + BS),  # clean again -> this loss clears
    ]
    from indexer.eventlog import LogFrame

    gpu_after = []
    for seq, ev in enumerate(frames):
        r.apply_frame(LogFrame(T0 + seq, "w", 0, seq, payload([ev])))
        gpu_after.append(idx.worker_stats("m")[("w", 0)]["gpu"])
    assert r.workers["w"].stream.resyncs == 2
    assert gpu_after == [1, 1, 0, 0, 1, 1, 2, 0, 1, 1, 0]


def test_array_form_events_apply_like_map_form() -> None:
    """Dynamo-style positional events take the full decoder; the result is the same."""
    from indexer.eventlog import LogFrame

    ev = store([5, 6], None, 0, "CPU_PINNED")
    arr = BlockStoredArr(*(getattr(ev, f) for f in ev.__struct_fields__))
    results = []
    for body in (payload([ev], 3), msgspec.msgpack.encode([T0, [arr], 3])):
        r = LogReplayer(KVIndex(), "m", BS)
        r.apply_frame(LogFrame(T0, "w", None, 0, body))
        results.append((r.index.worker_stats("m"), r.events, r.blocks, r.drops))
    assert results[0] == results[1]
    assert results[0][0][("w", 3)]["host"] == 2 and results[0][1] == {"BlockStored": 1}


# --- queries at recorded times --------------------------------------------------------------------------

def test_queries_are_answered_as_of_their_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "timed.kvlog"
    with EventLogWriter(log) as w:
        w.write(T0, "w0", 0, 0, payload([store([1, 2], None, 0)]))
        w.write(T0 + 2, "w0", 0, 1, payload([store([3, 4], 2, 2 * BS, "GPU")]))
        w.write(T0 + 2, "w1", 0, 0, payload([store([11, 12], None, 0, "CPU_PINNED")]))
        w.write(T0 + 4, "w0", 0, 2, payload([BlockRemoved([4, 3], "GPU")]))
    prompt = list(range(4 * BS)) + [99]
    times = [5, -1, 1, 2, 3, 0]  # shuffled on purpose; 2 and 0 coincide with frames
    rows = [{"t": t, "token_ids": prompt, "id": f"q{t}"} for t in times]
    rows.append({"t": 3, "token_ids": prompt, "lora_name": "other", "id": "lora"})
    rows.append({"t": 3, "token_ids": prompt, "model": "nope", "id": "bad-model"})
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    absfile = tmp_path / "abs.jsonl"
    absfile.write_text("".join(json.dumps({**r, "t": T0 + r["t"]}) + "\n" for r in rows))

    def answers(path: Path) -> dict[str, dict[str, Any]]:
        assert cli_main(["replay", str(log), "--apply", "--queries", str(path)]) == 0
        cap = capsys.readouterr()
        assert "replayed" in cap.err  # answers own stdout, the summary moves to stderr
        got = [json.loads(line) for line in cap.out.splitlines()]
        assert [a["at"] for a in got] == sorted(a["at"] for a in got)
        return {a["id"]: a for a in got}

    for path in (qfile, absfile):
        got = answers(path)

        def blocks(qid: str) -> dict[str, tuple[int, int]]:
            return {w["worker_id"]: (w["device_blocks"], w["cached_blocks"]) for w in got[qid]["workers"]}

        assert blocks("q-1") == {} and got["q-1"]["frames_applied"] == 0  # before any store
        assert blocks("q0") == {"w0": (2, 2)}  # a frame recorded at t is seen by a query at t
        assert blocks("q1") == {"w0": (2, 2)}
        assert blocks("q2") == {"w0": (4, 4), "w1": (0, 2)} and got["q2"]["frames_applied"] == 3
        assert blocks("q3") == {"w0": (4, 4), "w1": (0, 2)}
        assert blocks("q5") == {"w0": (2, 2), "w1": (0, 2)} and got["q5"]["frames_applied"] == 4
        assert got["q5"]["query_blocks"] == 4 and got["q5"]["line"] == 1
        assert set(blocks("lora").values()) == {(0, 0)}  # another namespace: no match
        assert "unknown model" in got["bad-model"]["error"]


def test_query_file_parsing_and_time_modes() -> None:
    qs = parse_queries([b'{"t": 1.5, "token_ids": [1, 2], "extra": "ignored"}', b"  ", b'{"t": 0, "token_ids": []}'])
    assert [q.line for q in qs] == [1, 3]
    assert resolve_query_times(qs, T0) == "offset" and [q.at for q in qs] == [T0, T0 + 1.5]
    assert resolve_query_times(qs, T0, "absolute") == "absolute" and qs[0].at == 0.0
    mixed = parse_queries([b'{"t": 1, "token_ids": []}', f'{{"t": {T0}, "token_ids": []}}'.encode()])
    with pytest.raises(QueryFileError, match="line 1 .* line 2"):
        resolve_query_times(mixed, T0)
    for bad, msg in [(b'{"t": 1}', "line 1: .*token_ids"), (b"{nope", "line 1: not a JSON"),
                     (b'{"t": "x", "token_ids": []}', "line 1: .*t"),
                     (b'{"t": 1, "token_ids": [-1]}', r"line 1: token ids must lie")]:
        with pytest.raises(QueryFileError, match=msg):
            parse_queries([bad])


# --- re-publishing ---------------------------------------------------------------------------------------

def test_publish_is_byte_identical_with_the_same_seqs(tmp_path: Path) -> None:
    log = tmp_path / "pub.kvlog"
    rng = random.Random(5)
    with EventLogWriter(log) as w:
        seqs = {"alpha": 0, "beta": 0}
        for i in range(120):
            wid = rng.choice(sorted(seqs))
            evs = [store([rng.getrandbits(63) for _ in range(rng.randint(1, 3))], None, rng.randrange(1000))]
            w.write(T0 + i * 0.001, wid, 2, seqs[wid], payload(evs, 2, T0 + i * 0.001))
            seqs[wid] += 1
    frames = list(read_event_log(log))
    proc = kvatlas("replay", str(log), "--publish", "alpha=tcp://127.0.0.1:*", "--publish", "beta=tcp://127.0.0.1:*",
                   "--replay-endpoint", "alpha=tcp://127.0.0.1:*", "--replay-endpoint", "beta=tcp://127.0.0.1:*",
                   "--hold", "inf", "--heartbeat", "0.05")
    got: dict[str, list[Batch]] = {"alpha": [], "beta": []}
    try:
        assert proc.stdout is not None
        mapping = {}
        while len(mapping) < 2:
            line = proc.stdout.readline()
            assert line, proc.communicate(timeout=10)
            m = re.match(r"publishing (\S+) on (\S+) replay (\S+)", line)
            if m:
                mapping[m.group(1)] = (m.group(2), m.group(3))
        with Subscriber(replay_timeout=5.0) as sub:
            for wid, (ep, rep) in mapping.items():
                sub.add(wid, ep, rep)

            def complete() -> bool:
                for d in sub.poll(50):
                    if isinstance(d, Gap):  # joined after the burst: the replay socket fills it
                        assert d.recovered, d
                        continue
                    assert isinstance(d, Batch), d  # never a restart
                    got[d.worker_id].append(d)
                return all(len(got[w]) >= seqs[w] for w in got)
            wait_until(complete, timeout=30, interval=0)
        proc.send_signal(signal.SIGINT)
        # Through the text stream, not communicate(): the readline above may already have buffered
        # the summary line, which communicate (reading the pipe's fd) would never see.
        out = proc.stdout.read()
        err = proc.stderr.read() if proc.stderr is not None else ""
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "re-published 120 of 120 frames from 2 worker(s)" in out
    for wid in got:
        recorded = [f for f in frames if f.worker == wid]
        received = got[wid][: len(recorded)]
        assert [b.seq for b in received] == [f.seq for f in recorded]
        assert [b.payload for b in received] == [f.payload for f in recorded], "payloads byte for byte"
        for hb in got[wid][len(recorded):]:  # after the log: only the idle heartbeats
            assert msgspec.msgpack.decode(hb.payload)[1:] == [[], 2]


def test_recorded_pacing_and_restart_on_publish(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "paced.kvlog"
    with EventLogWriter(log) as w:
        for i in range(5):
            w.write(T0 + 0.1 * i, "w0", 0, i, payload([]))
        w.write(T0 + 0.6, "w0", 0, 0, payload([]))  # the publisher restarted at 0.6 s
    port = free_port()
    for speed, floor, where in (("1.0", 0.6, ["--publish", "tcp://127.0.0.1:*"]),
                                ("2", 0.3, ["--publish-base-port", str(port)])):
        t = time.monotonic()
        assert cli_main(["replay", str(log), *where, "--speed", speed]) == 0
        took = time.monotonic() - t
        assert took >= floor, (speed, took)
        cap = capsys.readouterr()
        assert "re-published 6 of 6 frames" in cap.out and "restarts 1" in cap.out
        assert "restarted its publisher" in cap.err
        assert where[0] == "--publish" or f"publishing w0 on tcp://127.0.0.1:{port} (" in cap.out
    steps = list(republish_steps(read_event_log(log)))
    assert [s.restart for s in steps] == [False] * 5 + [True]
    assert pace_delay(T0, T0 + 1, 0.25, 2.0) == 0.25 and pace_delay(T0, T0 + 1, 0.0, 0) == 0.0


def test_publisher_planning() -> None:
    plans = plan_publishers(["b", "a"], [], [], base_port=6000, replay_base_port=7000, host="0.0.0.0")
    assert [(p.worker_id, p.endpoint, p.replay_endpoint) for p in plans] == [
        ("a", "tcp://0.0.0.0:6000", "tcp://0.0.0.0:7000"), ("b", "tcp://0.0.0.0:6001", "tcp://0.0.0.0:7001")]
    assert plan_publishers(["a"], [(None, "tcp://h:1")], [])[0].replay_endpoint is None
    for args, msg in [
        ((["a", "b"], [(None, "tcp://h:1")], []), "2 workers"),
        ((["a"], [("x", "tcp://h:1")], []), "not in the log"),
        ((["a", "b"], [("a", "tcp://h:1")], []), "no publish endpoint for worker.* b"),
        ((["a"], [("a", "tcp://h:1"), ("a", "tcp://h:2")], []), "twice"),
        (([], [], []), "no frames"),
    ]:
        with pytest.raises(ValueError, match=msg):
            plan_publishers(*args)
    with pytest.raises(ValueError, match="not all valid"):
        plan_publishers(["a", "b"], [], [], base_port=65535)


# --- bad input ---------------------------------------------------------------------------------------

def test_bad_inputs_exit_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.kvlog"
    write_chain_log(good, 2)
    two = tmp_path / "two.kvlog"
    with EventLogWriter(two) as w:
        w.write(T0, "a", 0, 0, payload([]))
        w.write(T0, "b", 0, 0, payload([]))
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a log\n")
    badq = tmp_path / "bad.jsonl"
    badq.write_text('{"t": 1, "token_ids": [1]}\n{"t": 2}\n')
    cases = [
        ([str(tmp_path / "missing.kvlog"), "--apply"], "no such file"),
        ([str(text), "--apply"], "not a kvatlas event log"),
        ([str(tmp_path), "--apply"], "is a directory"),
        ([str(good)], "choose one mode"),
        ([str(good), "--apply", "--publish", "tcp://127.0.0.1:*"], "choose one mode"),
        ([str(good), "--apply", "--block-size", "0"], "--block-size"),
        ([str(good), "--apply", "--queries", str(badq)], "bad.jsonl line 2"),
        ([str(good), "--apply", "--queries", str(tmp_path / "nope.jsonl")], "cannot read queries"),
        ([str(good), "--apply", "--answers", str(tmp_path / "a.jsonl")], "--answers needs --queries"),
        ([str(two), "--publish", "tcp://127.0.0.1:*"], "2 workers"),
        ([str(two), "--publish", "a=tcp://127.0.0.1:*", "--publish", "c=tcp://127.0.0.1:*"], "not in the log"),
        ([str(good), "--publish", "tcp://999.1.1.1:1"], "cannot bind"),
        ([str(good), "--publish", "tcp://127.0.0.1:*", "--queries", str(badq)], "only go with --apply"),
    ]
    for args, msg in cases:
        assert cli_main(["replay", *args]) == 2, args
        err = capsys.readouterr().err
        assert msg in err, (args, err)
    for args, msg in [([str(good), "--publish", "nonsense"], "expected an endpoint"),
                      ([str(good), "--publish", "tcp://127.0.0.1:*", "--speed", "-1"], "must be >= 0")]:
        with pytest.raises(SystemExit) as exc:
            cli_main(["replay", *args])
        assert exc.value.code == 2
        assert msg in capsys.readouterr().err


def test_replay_core_does_not_import_torch() -> None:
    code = ("import sys, indexer.replay, cli.replay, cli.main; "
            "bad = [m for m in ('torch', 'fastapi') if m in sys.modules]; assert not bad, bad")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
