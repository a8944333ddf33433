"""Worker churn at fleet width (docs/scaling.md, "The index at scale"): removing, adding and restarting
a worker costs that worker's entries, not the fleet. Counted, not timed: `U64Map.work` counts the
slots and value words the node table visits in whole-table passes and whole-value reads and writes,
and the keys of its nibble ops; the same churn at a fleet 10x wider must do the same work. Before
`clear_nibble` / `move_nibble` and the bounded `narrow`, each of the worker's blocks was read and
written as an int as wide as the fleet, and every removal scanned the table. The index's own
structures are checked too: a removal does not pass over the fleet's workers (`ModelState.by_id`)."""
from __future__ import annotations

import random

import pytest

from indexer.core import native as native_core
from indexer.index import KVIndex
from schemas.codec import encode_batch
from schemas.events import BlockStored, KVEventBatch
from support.counting import CountingDict

pytestmark = pytest.mark.skipif(not native_core.available(), reason="accelerator not built")

BS, DOC, SHARE = 4, 8, 4


def payloads(workers: int) -> list[bytes]:
    """Worker i stores document i // SHARE (DOC blocks): every node has SHARE holders."""
    rng = random.Random(0)
    docs = []
    for _ in range(-(-workers // SHARE)):
        toks = [rng.randrange(1, 50_000) for _ in range(DOC * BS)]
        docs.append(encode_batch(KVEventBatch(0.0, [BlockStored([rng.getrandbits(62) + 1 for _ in range(DOC)], None,
                                                                 toks, BS)])))
    return [docs[i // SHARE] for i in range(workers)]


def fleet(workers: int, native: bool = True) -> tuple[KVIndex, list[bytes]]:
    ix = KVIndex(native=native)
    ix.ensure_model("m", BS)
    pays = payloads(workers)
    for i, p in enumerate(pays):
        ix.apply_payload("m", f"w{i:05d}", 0, p)
    return ix, pays


def churn_work(workers: int) -> tuple[list[int], str]:
    """Node-table work of: removing a worker, removing the top slot's worker, restarting a high slot's
    (remove, then its stores again), adding a new one; and the table's form."""
    ix, pays = fleet(workers)
    m = ix._models["m"]
    nodes = m.nodes
    m.by_id = CountingDict(m.by_id)
    out = []
    for step in ("remove", "remove_top", "restart", "add"):
        w0, p0 = nodes.work, CountingDict.passes
        if step == "remove":
            assert ix.remove_worker("m", "w00005") == DOC
        elif step == "remove_top":  # the highest slot: trailing slots go, maybe a word with them
            assert ix.remove_worker("m", f"w{workers - 1:05d}") == DOC
        elif step == "restart":
            hi = f"w{workers - 2:05d}"  # a high slot: its values' ints are as wide as the fleet
            assert ix.remove_worker("m", hi) == DOC
            ix.apply_payload("m", hi, 0, pays[workers - 2])
        else:
            ix.apply_payload("m", "new", 0, pays[0])
        assert CountingDict.passes == p0, step
        out.append(nodes.work - w0)
    return out, nodes.form


@pytest.mark.parametrize("narrow_wide", [(40, 400), (200, 2000)])
def test_churn_work_follows_the_worker_not_the_fleet(narrow_wide: tuple[int, int]) -> None:
    small, wide = narrow_wide
    w_small, form_small = churn_work(small)
    w_wide, form_wide = churn_work(wide)
    assert form_wide == "lists"
    assert w_small == w_wide, (w_small, w_wide)
    # removals: one count per key of the worker's nibble op, no pass over the table
    assert w_wide[0] == w_wide[1] == w_wide[2] == DOC and w_wide[3] == 0


def test_churned_wide_fleet_answers_as_the_pure_core() -> None:
    """The nibble ops and the bounded narrow give the pure core's answers, across the turn from holder
    lists back to dense words as the fleet shrinks below 128 slots."""
    n = 160
    ixs = [fleet(n, native)[0] for native in (True, False)]
    pays = payloads(n)
    rng = random.Random(1)
    order = list(range(n))
    rng.shuffle(order)
    forms = set()
    for step, i in enumerate(order[:120]):
        for ix in ixs:
            ix.remove_worker("m", f"w{i:05d}")
            if step % 10 == 0:
                ix.apply_payload("m", f"w{i:05d}", 0, pays[i])  # a restart: back at once
        forms.add(ixs[0]._models["m"].nodes.form)
        if step % 7 == 0:
            assert ixs[0].worker_stats("m") == ixs[1].worker_stats("m")
            for doc_i in range(0, n, SHARE * 5):
                q = _doc_tokens(doc_i)
                a, b = (ix.score("m", q).workers for ix in ixs)
                assert a == b
    assert forms == {"lists", "dense"}
    assert ixs[0]._models["m"].nodes.width <= 8


def _doc_tokens(worker: int) -> list[int]:
    rng = random.Random(0)
    docs = []
    for _ in range(worker // SHARE + 1):
        docs.append([rng.randrange(1, 50_000) for _ in range(DOC * BS)])
        [rng.getrandbits(62) for _ in range(DOC)]
    return docs[worker // SHARE]
