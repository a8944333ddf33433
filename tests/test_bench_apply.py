"""`bench/bench_apply.py --shards`: its short mode runs, and what it measures is exact — worker-sharded
indexes applied by concurrent threads (the C run apply drops the GIL) hold, worker by worker, what one
index applied by one thread holds (docs/service.md, "Ingest shards": the design this bench measures).
Also the bench publishers' replay serving that `bench_service.py` and this bench's streams share."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from bench.bench_apply import apply_sharded, apply_stream  # noqa: E402
from bench.support.service_stream import BS, Stream  # noqa: E402

from indexer.index import KVIndex  # noqa: E402


def fresh(n: int) -> list[KVIndex]:
    out = [KVIndex() for _ in range(n)]
    for idx in out:
        idx.ensure_model("m", BS)
    return out


def test_short_mode_prints_the_ratio() -> None:
    r = subprocess.run([sys.executable, "-m", "bench.bench_apply", "--workers", "4", "--batches", "20", "--reps", "1",
                        "--shards", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if "2 shards on 2 threads" in ln]
    assert len(lines) == 2 and all("ratio" in ln for ln in lines), r.stdout


def test_bad_shard_count_is_refused() -> None:
    r = subprocess.run([sys.executable, "-m", "bench.bench_apply", "--shards", "1"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--shards must be 2 or more" in r.stderr


def test_sharded_concurrent_apply_equals_one_index() -> None:
    streams = [Stream(8, 40, seed=0), Stream(8, 40, seed=2)]
    [one] = fresh(1)
    shards = fresh(3)
    for st in streams:
        apply_stream(one, st)
        apply_sharded(shards, st)
    assert one.native and all(s.native for s in shards)  # the GIL-free C path is what runs concurrently
    # Every worker on exactly one shard, with the same blocks on the same tiers.
    merged: dict = {}
    for s in shards:
        stats = s.worker_stats("m")
        assert not merged.keys() & stats.keys()
        merged.update(stats)
    assert merged == one.worker_stats("m")
    assert sum(v.get("gpu", 0) for v in merged.values()) > 1000
    # Scores: one index's rows are the shards' rows put together, for deep and shallow queries.
    for doc in streams[0].docs + [m for st in streams for m in st.markers]:
        for size in (BS * 4, len(doc)):
            want = {(w.worker_id, w.dp_rank): w for w in one.score("m", doc[:size]).workers}
            got = {(w.worker_id, w.dp_rank): w for s in shards for w in s.score("m", doc[:size]).workers}
            assert got == want


def test_bench_publishers_answer_replays_in_round_robin_chunks(zmq_ctx) -> None:
    """bench_service's publishers serve every open replay a bounded chunk per call, so one long replay
    does not keep another publisher silent past a subscriber's replay timeout (the first bench run of
    2026-11-25 hung that way); every reply still arrives, in order, then the end marker."""
    import zmq

    from bench.support.service_stream import END_SEQ, REPLAY_CHUNK, RawPublisher

    pubs = [RawPublisher(zmq_ctx) for _ in range(2)]
    dealers = []
    try:
        for p in pubs:
            p.sent.extend(bytes([i % 251]) * 3 for i in range(REPLAY_CHUNK * 2 + 5))
            d = zmq_ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(p.replay_endpoint)
            d.send_multipart([b"", (3).to_bytes(8, "big")])
            dealers.append(d)
        got: list[list[int]] = [[], []]
        ended = [False, False]
        rounds = 0
        while not all(ended):
            rounds += 1
            assert rounds < 50
            for p in pubs:
                p.serve_replay()
            for i, d in enumerate(dealers):
                n_round = 0
                while d.poll(200 if not got[i] else 20):
                    _, _, seq, payload = d.recv_multipart()
                    if seq == END_SEQ:
                        ended[i] = True
                        break
                    got[i].append(int.from_bytes(seq, "big"))
                    assert payload == pubs[i].sent[got[i][-1]]
                    n_round += 1
                assert n_round <= REPLAY_CHUNK  # bounded per call
        want = list(range(3, REPLAY_CHUNK * 2 + 5))
        assert got == [want, want] and rounds >= 3 and not any(p.replays for p in pubs)
    finally:
        for d in dealers:
            d.close(0)
        for p in pubs:
            p.close()
