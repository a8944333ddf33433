"""The soak's simulated producer answers a resync like a kvatlas producer: its snapshot batch,
applied to an index holding anything at all for that worker, leaves exactly its state."""
from __future__ import annotations

from indexer.index import KVIndex
from schemas.codec import encode_batch
from schemas.events import KVEventBatch
from support.service import WorkerSim, make_prompts

BS = 4


def test_worker_sim_snapshot_rebuilds_its_exact_state() -> None:
    for native in (True, False):
        sim = WorkerSim(7, BS, make_prompts(5, BS))
        idx = KVIndex(native=native)
        idx.ensure_model("m", BS)
        for i in range(400):
            evs = sim.step()
            if i % 3:  # a third of the stream is lost: only the snapshot can make it right
                idx.apply_payload("m", "w", 0, encode_batch(KVEventBatch(ts=1.0, events=evs)), rank_from_batch=True)
        idx.apply_payload("m", "w", 0, encode_batch(KVEventBatch(ts=1.0, events=sim.snapshot())), rank_from_batch=True)
        for q in sim.sample_queries(200):
            got = idx.score("m", q).workers[0]
            exp = sim.expect(q)
            assert (got.device_blocks, got.cached_blocks) == (exp["device_blocks"], exp["cached_blocks"])
            assert {k: got.tiers.get(k, 0) for k in exp["tiers"]} == exp["tiers"]
