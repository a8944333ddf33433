"""The simulated engine serves what it has been handed in virtual-arrival order: a request that
reached it late (after a later arrival, as a loaded router or network delivers it) is served before
the later one still waiting, so the cache and the timeline see the trace's order, not the wall
clock's (docs/end-to-end.md, "The worker")."""
from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sim import cmd as worker_cmd
from sim.api import SimModel
from sim.engine import Engine
from producer.storage.config import make_storage_backend
from producer.storage.worker import StorageWorker

B = 16


@contextmanager
def engine(tmp: Path) -> Iterator[Engine]:
    """A simulated engine over a small tiered cache (L3 on a directory), closed with its cache's workers."""
    p = argparse.ArgumentParser()
    worker_cmd.add_arguments(p)
    args = p.parse_args(["--block-size", str(B), "--gpu-pages", "64", "--host-pages", "128"])
    storage = StorageWorker(make_storage_backend("file", {"root": str(tmp / "l3")}))
    e = Engine(worker_cmd._make_cache(args, storage, None), SimModel())
    try:
        yield e
    finally:
        e.close()
        if e.cache.transfer is not None:
            e.cache.transfer.close()
        if e.cache.storage is not None:
            e.cache.storage.close()


def test_a_late_request_is_served_before_a_later_arrival_waiting_with_it(tmp_path: Path) -> None:
    with engine(tmp_path) as e:
        shared = list(range(1, 4 * B + 1))
        with e.lock:  # the engine thread is busy (it blocks in its first request) while both arrive
            first = e.submit(list(range(1000, 1000 + 2 * B)), 1, 0.0)
            later = e.submit(shared, 1, 5.0)   # handed over first...
            early = e.submit(shared, 1, 2.0)   # ...but arrived earlier on the virtual clock
        first.result(30)
        a, b = early.result(30), later.result(30)
        # the early one ran first: it computed the shared prompt, the later one found it cached
        assert a.tokens.computed == 4 * B and a.tokens.cached == 0
        assert b.tokens.cached == 4 * B and b.tokens.computed == 0
        assert a.ttft_s > 0 and b.arrival_cached == 4 * B


def test_equal_arrivals_keep_their_submission_order(tmp_path: Path) -> None:
    with engine(tmp_path) as e:
        shared = list(range(1, 4 * B + 1))
        with e.lock:
            first = e.submit(list(range(1000, 1000 + 2 * B)), 1, 0.0)
            x = e.submit(shared, 1, 3.0)
            y = e.submit(shared, 1, 3.0)
        first.result(30)
        assert x.result(30).tokens.computed == 4 * B and y.result(30).tokens.cached == 4 * B


def test_a_barrier_completes_after_every_request_handed_over_before_it(tmp_path: Path) -> None:
    with engine(tmp_path) as e:
        with e.lock:  # nothing is served until the barrier is in the queue too
            futs = [e.submit(list(range(100 * i, 100 * i + 2 * B)), 1, float(10 - i)) for i in range(3)]
            done = e.barrier()
        done.result(30)
        assert all(f.done() for f in futs)
        t, queued, running, backlog, free_at = e.load(0.0)
        assert free_at >= max(f.result().ttft_s + 10 - i for i, f in enumerate(futs)) - 1e-9  # their prefills
