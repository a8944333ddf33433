"""Embedded mode (router_api.embedded): real ZeroMQ publishers, the service's ingest loop and
reconciliation in the test's own process, scores checked against the brute-force reference."""
from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest

from support.net import free_port, wait_until
from producer.page_hash import page_ids
from producer.publisher import ZmqEventPublisher
from router_api.embedded import EmbeddedIndexer
from router_api.registry import DuplicateWorker
from router_api.service import UnknownModel
from schemas.api import ScoreResponse
from schemas.events import AllBlocksCleared, BlockStored, KVEventBatch
from support.reference import ReferenceIndex

BS = 4


def _store(tokens: list[int], parent_tokens: list[int] | None = None) -> BlockStored:
    ids = page_ids((parent_tokens or []) + tokens, BS)
    n_parent = len(parent_tokens or []) // BS
    return BlockStored(block_hashes=ids[n_parent:], parent_block_hash=ids[n_parent - 1] if n_parent else None,
                       token_ids=tokens, block_size=BS, medium="GPU")


class Pubs:
    def __init__(self, n: int) -> None:
        self.pubs = {f"w{i}": ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}",
                                                replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
                     for i in range(n)}

    def specs(self) -> list[dict[str, str]]:
        return [{"worker_id": w, "endpoint": p.endpoint, "replay_endpoint": p.replay_endpoint}
                for w, p in self.pubs.items()]

    def close(self) -> None:
        for p in self.pubs.values():
            p.close()


@pytest.fixture
def pubs() -> Pubs:
    ps = Pubs(3)
    yield ps
    ps.close()


def _wait_seen(idx: EmbeddedIndexer, pubs: Pubs, probe: list[int]) -> None:
    """Each publisher stores `probe` until every worker shows it (a PUB drops what it sends before
    the SUB is connected; the replay then recovers any gap)."""
    for p in pubs.pubs.values():
        p.publish([_store(probe)])

    def seen() -> bool:
        res = idx.score(probe)
        if all(s.cached_blocks == len(probe) // BS for s in res.workers) and len(res.workers) == len(pubs.pubs):
            return True
        for p in pubs.pubs.values():
            p.heartbeat()
        return False
    wait_until(seen, timeout=15)


def test_embedded_scores_match_reference(pubs: Pubs) -> None:
    rng = random.Random(3)
    ref = ReferenceIndex()
    ref.ensure_model("default", BS)
    probe = [9] * BS
    with EmbeddedIndexer(pubs.specs(), block_size=BS, stale_after_s=600, remove_after_s=3600) as idx:
        _wait_seen(idx, pubs, probe)
        for wid in pubs.pubs:
            ref.apply("default", wid, 0, KVEventBatch(0.0, [_store(probe)]))
        prompts = [[rng.randrange(1, 5000) for _ in range(BS * 6)] for _ in range(8)]
        for step in range(40):
            wid = rng.choice(list(pubs.pubs))
            prompt = rng.choice(prompts)
            cut = BS * rng.randint(1, 6)
            events = [_store(prompt[:cut])]
            if step == 25:
                events = [AllBlocksCleared()] + events
            pubs.pubs[wid].publish(events)
            ref.apply("default", wid, 0, KVEventBatch(0.0, events))
        for p in pubs.pubs.values():
            assert p.flush(10)
        marks = {w: p.next_seq - 1 for w, p in pubs.pubs.items()}  # exact once the queue is empty
        wait_until(lambda: all((idx.service.registry.get(w).last_seq or -1) >= s for w, s in marks.items()),
                   timeout=15)
        for prompt in prompts:
            got = idx.score(prompt)
            assert isinstance(got, ScoreResponse)
            want = {(s.worker_id, s.dp_rank): s.cached_blocks for s in ref.score("default", prompt).workers}
            assert {(s.worker_id, s.dp_rank): s.cached_blocks for s in got.workers} == want
            # a u32 array is scored the same as a list
            arr = idx.score(np.asarray(prompt, dtype=np.uint32))
            assert arr.workers == got.workers
            q = idx.query(prompt)
            assert {w: i.longest_matched for w, i in q.instances.items()} == \
                {w: n * BS for (w, _r), n in want.items()}
        best = idx.score(prompts[0]).best
        assert best is None or best.worker_id in pubs.pubs


def test_embedded_membership_and_errors(pubs: Pubs) -> None:
    specs = pubs.specs()
    idx = EmbeddedIndexer(specs[:1], block_size=BS)
    assert idx.score([1] * BS).workers == []  # before start(): an empty index, not an error
    idx.start()
    try:
        st = idx.add_worker(specs[1])
        assert st.worker_id == "w1" and st.block_size == BS
        with pytest.raises(DuplicateWorker):
            idx.add_worker(specs[1])
        assert [w.worker_id for w in idx.workers().workers] == ["w0", "w1"]
        idx.remove_worker("w1")
        assert [s.worker_id for s in idx.score([1] * BS).workers] == ["w0"]
        with pytest.raises(UnknownModel):
            idx.score([1] * BS, model="other")
        with pytest.raises(ValueError, match="bad worker registration"):
            idx.add_worker({"worker_id": "w9"})  # no endpoint
    finally:
        idx.close()
        idx.close()  # idempotent
    assert not idx.service.ingest.alive


def test_embedded_import_is_http_free() -> None:
    """A router embedding the index does not pay for (or need) the HTTP stack."""
    code = ("import sys, router_api.embedded; "
            "bad = [m for m in ('fastapi', 'uvicorn', 'starlette', 'torch') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
