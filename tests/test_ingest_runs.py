"""Runs: the live ingest applies in-order batches received together with one `Index.apply_run`
call (router_api/ingest.py, `IngestLoop._on_run`). For any stream — stores on every tier, removes,
clears, heartbeats, other dp_ranks, orphans (held, attached, expired), non-full-attention and
partial blocks, odd bytes — cut into runs anyhow, the index, the metrics and the policy's state
must equal those of the same batches delivered one by one."""
from __future__ import annotations

import time
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from indexer.deliveries import Batch, Run
from producer.page_hash import page_ids
from router_api import ingest as ingest_mod
from router_api.config import ServiceConfig
from router_api.service import IndexerService
from schemas.api import RegisterWorker
from schemas.codec import encode_batch
from schemas.events import BlockStored, KVEventBatch
from support.ingest_payloads import BS, WORKERS, make_payloads


class CountingIndex:
    """The service's index, with the sizes of what `apply_run` was given and applied whole."""

    def __init__(self, index: Any) -> None:
        self._index = index
        self.calls: list[tuple[int, int]] = []

    def apply_run(self, *args: Any) -> Any:
        res = self._index.apply_run(*args)
        self.calls.append((len(args[4]), res[0]))
        return res

    def __getattr__(self, name: str) -> Any:
        return getattr(self._index, name)


def service() -> IndexerService:
    svc = IndexerService(ServiceConfig(port=0, block_size=BS, stale_after_s=600, remove_after_s=3600))
    svc.ingest._wall = lambda: 2000.0  # lag is wall - ts: the same clock for both sides
    svc.ingest._clock = lambda: 50.0
    for i, wid in enumerate(WORKERS):
        svc.register(RegisterWorker(worker_id=wid, endpoint=f"tcp://127.0.0.1:{20000 + i}", block_size=BS))
    return svc


def light(svc: IndexerService) -> tuple:
    """What the policy and the API know of each worker (cheap enough to compare after every run)."""
    out = []
    for wid in WORKERS:
        s = svc.registry.get(wid)
        out.append((s.last_seq, s.batches, s.heartbeats, s.clean, s.resync_until, s.resyncs, sorted(s.dp_ranks),
                    s.lag, svc.ingest._tally.lag.get((wid,))))
    return tuple(out)


def outcome(svc: IndexerService) -> dict[str, Any]:
    loop = svc.ingest
    loop._tally.flush(svc.metrics)
    state = {}
    for wid in WORKERS:
        s = svc.registry.get(wid)
        state[wid] = (s.last_seq, s.batches, s.heartbeats, s.clean, s.resync_until, s.resyncs,
                      sorted(s.dp_ranks), s.lag)
    dump = {(w, r): sorted(map(repr, evs)) for w, r, evs in svc.index.dump("default")}
    return {"state": state, "dump": dump, "workers": svc.index.worker_stats("default"),
            "events": svc.metrics.events.items(), "drops": svc.metrics.drops.items(),
            "batches": svc.metrics.batches.items(), "lag": svc.metrics.worker_lag.items(),
            "applied": loop.applied_batches, "resyncs": svc.metrics.resyncs.items()}


@settings(max_examples=60, deadline=None)
@example(seed=1, n=60, odd=0.0, cuts=[12], hold=64)  # long runs, always (the coverage check below counts on them)
@example(seed=2, n=60, odd=0.02, cuts=[5, 12], hold=3)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 60), odd=st.sampled_from([0.0, 0.02, 0.1, 0.3, 1.0]),
       cuts=st.lists(st.integers(1, 12), min_size=1, max_size=20), hold=st.sampled_from([1, 3, 64]))
def test_runs_equal_one_by_one(seed: int, n: int, odd: float, cuts: list[int], hold: int) -> None:
    old_hold = ingest_mod.RUN_HOLD
    ingest_mod.RUN_HOLD = hold  # runs longer than a lock hold are applied in chunks
    try:
        check_runs_equal_one_by_one(seed, n, odd, cuts)
    finally:
        ingest_mod.RUN_HOLD = old_hold


def check_runs_equal_one_by_one(seed: int, n: int, odd: float, cuts: list[int]) -> None:
    streams = {wid: make_payloads(seed + k, n, odd) for k, wid in enumerate(WORKERS)}
    one, runs = service(), service()
    counting = runs.ingest.index = CountingIndex(runs.ingest.index)
    pos = {wid: 0 for wid in WORKERS}
    c = 0
    while any(pos[w] < n for w in WORKERS):  # the workers' runs interleaved, cut at `cuts`
        for wid in WORKERS:
            if pos[wid] < n:
                size = cuts[c % len(cuts)]
                c += 1
                chunk = streams[wid][pos[wid]:pos[wid] + size]
                runs.ingest._handle(Run(wid, pos[wid], chunk, 0.0))
                for k, p in enumerate(chunk):
                    one.ingest._handle(Batch(wid, pos[wid] + k, p, 0.0))
                pos[wid] += len(chunk)
                assert light(runs) == light(one)  # equal at every run's end, not only at the last
    assert outcome(runs) == outcome(one)
    RUN_BATCHES.append(sum(k for _, k in counting.calls))


RUN_BATCHES: list[int] = []


def test_the_streams_above_took_the_run_path() -> None:
    """The property is only worth as much as the share of batches the run path took."""
    assert RUN_BATCHES and sum(RUN_BATCHES) > 150, RUN_BATCHES


def test_a_long_common_case_run_is_one_index_call() -> None:
    svc = service()
    toks = [i % 97 + 1 for i in range(BS * 200)]
    ids = page_ids(toks, BS)
    payloads = [encode_batch(KVEventBatch(1999.0, [BlockStored(ids[i:i + 2], ids[i - 1] if i else None,
                                                              toks[i * BS:(i + 2) * BS], BS, None, "GPU")]))
                for i in range(0, 200, 2)]
    counting = svc.ingest.index = CountingIndex(svc.ingest.index)
    svc.ingest._handle(Run("w0", 0, payloads, 0.0))
    assert counting.calls == [(64, 64), (36, 36)]  # RUN_HOLD batches a lock hold
    assert svc.index.score("default", toks).workers[0].device_blocks == 200
    assert svc.registry.get("w0").last_seq == 99 and svc.ingest.applied_batches == 100
    assert svc.registry.get("w0").lag == 1.0




def test_a_burst_received_as_runs_is_trimmed_once_drained() -> None:
    """The memory trimmer counts batches, not deliveries: a burst of runs still returns its buffers."""
    from support.service import service_with_publisher
    from support.net import wait_until

    with service_with_publisher(BS) as (svc, pub):
        trims0 = svc.ingest.trimmer.trims
        n = svc.ingest.trimmer.min_batches + 500
        toks = [(7 * i) % 32000 + 1 for i in range(n * BS)]
        ids = page_ids(toks, BS)
        for b in range(n):
            pub.publish([BlockStored(ids[b:b + 1], ids[b - 1] if b else None, toks[b * BS:(b + 1) * BS], BS, None,
                                     "GPU")])
        assert pub.flush(20)
        last = pub.next_seq - 1
        wait_until(lambda: svc.registry.get("w0").last_seq == last, timeout=30)
        wait_until(lambda: svc.ingest.trimmer.trims > trims0, timeout=10)


def test_the_ingest_thread_idles_without_workers() -> None:
    """No worker: nothing to poll (an empty ZeroMQ poll returns at once); the thread must wait for a
    command, not spin (it used to burn a core and slow /health 8x)."""
    from support.net import wait_until

    svc = IndexerService(ServiceConfig(port=0, block_size=BS))
    svc.start()
    try:
        tid = svc.ingest.thread.native_id

        def cpu() -> float:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                return int(f.read().split()[0]) / 1e9
        c0, t0 = cpu(), time.monotonic()
        wait_until(lambda: time.monotonic() - t0 >= 1.0, timeout=5)
        assert cpu() - c0 < 0.1
        # ... and still subscribes at once when a worker registers.
        svc.register(RegisterWorker(worker_id="w0", endpoint="tcp://127.0.0.1:20999", block_size=BS))
        wait_until(lambda: svc.ingest._sub is not None and svc.ingest._sub.workers() == ["w0"], timeout=10)
    finally:
        svc.stop(final_snapshot=False)
