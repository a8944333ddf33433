"""bench/support/service_stream.py's streams (what bench_service.py measures memory per resident entry
on): the `unshared` stream's evictions leave exactly the entries its truth (`Stream.stored`) says, on
both event shapes, on the accelerated and the pure core, and its nodes have one holder each."""
from __future__ import annotations

import pytest

from bench.support.service_stream import BS, Stream
from producer.page_hash import page_ids
from indexer.index import KVIndex


def applied(stream: Stream, native: bool) -> KVIndex:
    ix = KVIndex(native=native)
    ix.ensure_model("m", BS)
    for w, pays in enumerate(stream.payloads):
        for p in pays:
            ix.apply_payload("m", f"w{w}", 0, p)
    return ix


@pytest.mark.parametrize("shape", ["map", "array"])
@pytest.mark.parametrize("native", [True, False])
def test_unshared_stream_leaves_its_truth_resident(shape: str, native: bool) -> None:
    st = Stream(4, 60, shape=shape, kind="unshared")
    assert st.removed > 0 and st.entries == st.blocks - st.removed
    ix = applied(st, native)
    assert ix.native is native
    gpu = {w: stats["gpu"] for (w, _rank), stats in ix.worker_stats("m").items()}
    assert gpu == {f"w{w}": len(s) for w, s in enumerate(st.stored)}
    # every node has one holder: the table holds one node per entry
    assert len(ix._models["m"].nodes) == len(set().union(*st.stored)) == st.entries
    # the sampled requests (the first is evicted four requests later, the others kept): each worker's
    # match is its truth's, the leading blocks it still holds
    evicted = kept = 0
    for w in range(len(st.stored)):
        for toks in st.requests[w * 4:(w + 1) * 4]:
            ids = page_ids(toks, BS)
            want = next((i for i, h in enumerate(ids) if h not in st.stored[w]), len(ids))
            got = {r.worker_id: r.cached_blocks for r in ix.score("m", toks).workers}.get(f"w{w}", 0)
            assert got == want
            evicted += want == 0
            kept += want == len(ids)
    assert evicted == len(st.stored) and kept == 3 * len(st.stored)


def test_shared_stream_has_no_evictions() -> None:
    st = Stream(4, 30, kind="shared")
    assert st.removed == 0 and st.entries == st.blocks
