"""One worker's raw event stream with every odd case mixed in, for the ingest-run tests
(test_ingest_runs, test_index_apply_run)."""
from __future__ import annotations

import random
from typing import Any

from producer.page_hash import page_ids
from schemas.codec import encode_batch
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BS = 4
WORKERS = ("w0", "w1")
MEDIA = ("GPU", "CPU_PINNED", "DISK", "EXTERNAL")


def make_payloads(seed: int, n: int, odd: float) -> list[bytes]:
    """One worker's stream: mostly chains continuing what it stored, with every odd case mixed in
    (`odd` scales how often: rare odd cases leave long runs, frequent ones cut them short)."""
    rng = random.Random(seed)
    stored: list[int] = []
    alive: list[int] = []  # stored and neither removed nor cleared since: safe parents
    out: list[bytes] = []
    base = 1000.0
    for _ in range(n):
        base += 0.5
        ts = rng.choice([float("nan"), -1.0, 0.0]) if rng.random() < odd else base  # odd ts: no lag from those
        kind = rng.random()
        rank = rng.choice([None, 0, 0]) if rng.random() > odd else 1
        if kind < 0.3 * odd:
            out.append(rng.choice([b"", b"\xc1", b"\x92\xcb", b"\x93\x01\x90\x01\xff"]))
            continue
        if kind < 0.6 * odd:
            out.append(encode_batch(KVEventBatch(ts, [], rank)))  # a heartbeat
            continue
        events: list[Any] = []
        for _ in range(rng.randint(1, 3)):
            r = rng.random()
            if r < 0.6 or not stored:
                toks = [rng.randrange(1, 50) for _ in range(BS * rng.randint(1, 4))]
                parent = rng.choice(alive) if alive and rng.random() < 0.7 else None
                if rng.random() < 0.2 * odd:
                    parent = rng.randrange(1 << 40, 1 << 41)  # an orphan: a parent never stored
                ids = page_ids(toks, BS)
                if parent is not None:
                    ids = [(i ^ parent) & ((1 << 62) - 1) for i in ids]
                if rng.random() < 0.3 * odd:
                    toks = toks[:-1]  # a partial trailing block
                ev = BlockStored(ids, parent, toks, BS if rng.random() > 0.2 * odd else BS * 2, None,
                                 rng.choice(MEDIA))
                if rng.random() < 0.2 * odd:
                    ev.kv_cache_spec_kind = "sliding_window"
                events.append(ev)
                stored += ids
                alive += ids
            elif r < 0.9:
                gone = rng.sample(stored, min(len(stored), rng.randint(1, 3)))
                events.append(BlockRemoved(gone, rng.choice(MEDIA)))
                alive = [h for h in alive if h not in gone]
            else:
                events.append(AllBlocksCleared())
                alive = []
        out.append(encode_batch(KVEventBatch(ts, events, rank)))
    return out
