"""One worker's events never change another worker's rows (issue 24 item 1; docs/hybrid.md, "The
indexer"): group layouts are learned per worker and dp rank, a layout change resets that worker only
(counted), a worker's layout goes with it, and snapshots and ingest shards keep all of this.

The property: for any event sequences of workers A and B of one model, A's score rows equal those
of A's events applied alone — native and pure, one index and worker-sharded. The shared pool is the
one deliberate cross-worker rule (an EXTERNAL claim is usable by every worker of the model), so the
histories here use the worker-private tiers only."""
from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.core.groups import GROUP_CAP
from indexer.index import KVIndex
from indexer.sharded import ShardedIndex
from schemas.codec import encode_batch
from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

M = "m"
BS = 4
ROOTS = [[1 + (i * 7 + r) % 5 for i in range(BS * 6)] for r in range(2)]  # two 6-block prompts
KINDS = ["full_attention", "full_attention", "sliding_window", "mamba", "cross_attention"]


def _hashes(root: int) -> list[int]:
    return [root * 100 + i + 1 for i in range(6)]


@st.composite
def event(draw: Any) -> Any:
    r = draw(st.integers(0, 9))
    root = draw(st.integers(0, 1))
    hs = _hashes(root)
    a = draw(st.integers(0, 5))
    b = draw(st.integers(a + 1, 6))
    medium = draw(st.sampled_from(["GPU", "GPU", "CPU_PINNED", "DISK"]))
    gi = draw(st.sampled_from([None, 0, 0, 1, 1, 2, 3]))
    kind = draw(st.sampled_from(KINDS))
    window = draw(st.sampled_from([None, 5, 9]))
    if r < 6:
        toks = ROOTS[root][a * BS:b * BS]
        return BlockStored(hs[a:b], hs[a - 1] if a else None, toks, BS, None, medium, group_idx=gi,
                           kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)
    if r < 7:  # a placeholder: a new tier on blocks already mapped
        return BlockStored(hs[a:b], None, [], 0, None, medium, group_idx=gi, kv_cache_spec_kind=kind,
                           kv_cache_spec_sliding_window=window)
    if r < 9:
        return BlockRemoved(hs[a:b], medium, group_idx=gi)
    return AllBlocksCleared()


history = st.lists(st.tuples(st.sampled_from(["A", "B"]), st.lists(event(), min_size=1, max_size=3)), max_size=30)


def _index(kind: str) -> Any:
    if kind == "sharded-same":
        ix: Any = ShardedIndex(2, placement=lambda w: 0)
    elif kind == "sharded-apart":
        ix = ShardedIndex(2, placement=lambda w: 0 if w == "A" else 1)
    else:
        ix = KVIndex(native=kind == "native")
    ix.ensure_model(M, BS)
    return ix


def _feed(ix: Any, wid: str, evs: list, raw: bool) -> None:
    b = KVEventBatch(0.0, evs)
    if raw:
        ix.apply_payload(M, wid, 0, encode_batch(b))
    else:
        ix.apply(M, wid, 0, b)


def _rows(ix: Any, wid: str) -> list:
    out = []
    for root in ROOTS:
        for n in (2, 4, 6):
            out.append([s for s in ix.score(M, root[: n * BS]).workers if s.worker_id == wid])
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hist=history, kind=st.sampled_from(["native", "pure", "sharded-same", "sharded-apart"]), raw=st.booleans())
def test_a_workers_rows_are_its_own_events_alone(hist, kind: str, raw: bool) -> None:
    both, alone = _index(kind), _index(kind)
    alone.register_worker(M, "A")
    both.register_worker(M, "A")
    for wid, evs in hist:
        _feed(both, wid, evs, raw)
        if wid == "A":
            _feed(alone, wid, evs, raw)
    want = _rows(alone, "A")
    assert _rows(both, "A") == want
    assert both.worker_stats(M)[("A", 0)] == alone.worker_stats(M)[("A", 0)]
    back = _index(kind)  # a restart from the snapshot
    back.load_dump(M, BS, both.dump(M))
    assert _rows(back, "A") == want
    both.remove_worker(M, "B")
    assert _rows(both, "A") == want
    _feed(both, "A", [BlockStored(_hashes(0)[:2], None, ROOTS[0][: 2 * BS], BS, None, "GPU")], raw)
    _feed(alone, "A", [BlockStored(_hashes(0)[:2], None, ROOTS[0][: 2 * BS], BS, None, "GPU")], raw)
    assert _rows(both, "A") == _rows(alone, "A")


def _kv(hs: list[int], n: int, gi: int | None = 0, kind: str = "full_attention") -> BlockStored:
    return BlockStored(hs[:n], None, ROOTS[0][: n * BS], BS, None, "GPU", group_idx=gi, kv_cache_spec_kind=kind)


def test_one_hostile_group_event_leaves_other_workers_exact() -> None:
    """Issue 24 item 1's reproduction: w0 holds 6 full-attention blocks; another worker sends one Mamba
    store in group 1. w0 stays 6/6 (no kv_blocks: it has no groups), also for its new stores, for new
    workers, after the hostile worker is deleted, across a snapshot and across ingest shards."""
    hs = _hashes(0)
    for kind in ("native", "pure", "sharded-same", "sharded-apart"):
        ix = _index(kind)
        _feed(ix, "w0", [_kv(hs, 4)], raw=True)
        _feed(ix, "A", [BlockStored([hs[0]], None, ROOTS[0][:BS], BS, None, "GPU", group_idx=1,
                                    kv_cache_spec_kind="mamba")], raw=True)
        _feed(ix, "w0", [_kv(hs, 6)], raw=True)
        ix.register_worker(M, "w9")
        _feed(ix, "w9", [_kv(hs, 6)], raw=True)
        for wid in ("w0", "w9"):
            s = next(s for s in ix.score(M, ROOTS[0]).workers if s.worker_id == wid)
            assert (s.device_blocks, s.cached_blocks, s.kv_blocks) == (6, 6, None), (kind, wid)
        a = next(s for s in ix.score(M, ROOTS[0]).workers if s.worker_id == "A")
        assert (a.device_blocks, a.cached_blocks, a.kv_blocks) == (0, 0, 0), kind  # its own rows: no KV
        back = _index(kind)
        back.load_dump(M, BS, ix.dump(M))
        assert back.score(M, ROOTS[0]) == ix.score(M, ROOTS[0])
        ix.remove_worker(M, "A")
        s = ix.score(M, ROOTS[0]).workers[0]
        assert (s.device_blocks, s.cached_blocks, s.kv_blocks) == (6, 6, None)


def test_a_layout_change_resets_that_worker_only() -> None:
    """An honest hybrid worker keeps its layout whatever another worker declares for the same group
    numbers; a worker that changes its own layout (engine restarted with another config) loses its
    state, counted as ("layout", "ALL", "reset")."""
    hs = _hashes(0)
    for native in (True, False):
        ix = _index("native" if native else "pure")
        for wid, kind in (("honest", "sliding_window"), ("other", "mamba")):
            _feed(ix, wid, [_kv(hs, 6), BlockStored(hs[:6], None, ROOTS[0], BS, None, "GPU", group_idx=1,
                                                    kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=9)], raw=True)
        rows = {s.worker_id: (s.device_blocks, s.cached_blocks, s.kv_blocks) for s in ix.score(M, ROOTS[0]).workers}
        assert rows == {"honest": (6, 6, 6), "other": (6, 6, 6)}
        st = ix.apply(M, "other", 0, KVEventBatch(0.0, [BlockStored([hs[5]], hs[4], ROOTS[0][5 * BS:], BS, None, "GPU",
                                                                    group_idx=1, kv_cache_spec_kind="sliding_window")]))
        assert st.counts[("layout", "ALL", "reset")] == 1
        assert st.drops == {"group_orphan": 1}  # its KV went with the reset: the store has no parent now
        rows = {s.worker_id: (s.device_blocks, s.cached_blocks, s.kv_blocks) for s in ix.score(M, ROOTS[0]).workers}
        assert rows == {"honest": (6, 6, 6), "other": (0, 0, 0)}


def test_groups_per_worker_are_capped_and_counted() -> None:
    """A publisher naming more than GROUP_CAP groups (over all its ranks) gets the excess dropped and
    counted; another worker's groups are not limited by it, and the model keeps no group of a worker
    that left."""
    hs = _hashes(0)
    for native in (True, False):
        ix = _index("native" if native else "pure")
        evs = [_kv(hs, 6)] + [BlockStored([hs[0]], None, ROOTS[0][:BS], BS, None, "GPU", group_idx=g,
                                          kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=5)
                              for g in range(1, GROUP_CAP + 5)]
        st = ix.apply(M, "flood", 0, KVEventBatch(0.0, evs))
        assert st.drops == {"group_limit": 4} and st.counts[("group_stored", "GPU", "new")] == GROUP_CAP
        st = ix.apply(M, "flood", 1, KVEventBatch(0.0, evs))  # its other ranks share the same budget
        assert st.drops == {"group_limit": 4}
        st = ix.apply(M, "flood", 2, KVEventBatch(0.0, [_kv(hs, 6), BlockStored(
            [hs[0]], None, ROOTS[0][:BS], BS, None, "GPU", group_idx=1, kv_cache_spec_kind="mamba")]))
        assert st.drops == {"group_limit": 1}  # a 17th distinct group (1, mamba) for this worker id
        st = ix.apply(M, "honest", 0, KVEventBatch(0.0, evs[: 3]))
        assert not st.drops
        ix.remove_worker(M, "flood")
        assert set(ix._models[M].groups.classes) == {(1, 1, 5), (2, 1, 5)}  # the honest worker's only


def test_a_hostile_layout_costs_a_score_linear_work(monkeypatch) -> None:
    """Issue 24 item 7: the usable-prefix search reads each block of each group at most once per tier
    limit, whatever the residency pattern — here 15 sliding-window groups holding every block and a
    Mamba group with one state at block 0, which used to re-run the window checks at every depth
    (seconds for a 480k-token query). Counted in tier look-ups, not wall time."""
    import indexer.core.groupscore as gs

    n = 300
    toks = [1 + (i * 13) % 97 for i in range(n * BS)]
    hs = list(range(1, n + 1))
    evs: list = [BlockStored(hs, None, toks, BS, None, "GPU")]
    evs += [BlockStored(hs, None, toks, BS, None, "GPU", group_idx=g, kv_cache_spec_kind="sliding_window",
                        kv_cache_spec_sliding_window=64 + g) for g in range(1, 16)]
    evs.append(BlockStored(hs[:1], None, toks[:BS], BS, None, "GPU", group_idx=16, kv_cache_spec_kind="mamba"))
    calls = [0]
    real = gs._code

    def counted(r: int, sh: int, pool_bits: int) -> int:
        calls[0] += 1
        return real(r, sh, pool_bits)

    monkeypatch.setattr(gs, "_code", counted)
    for native in (True, False):
        ix = KVIndex(native=native)
        ix.ensure_model(M, BS)
        ix.apply(M, "evil", 0, KVEventBatch(0.0, evs))
        calls[0] = 0
        s = ix.score(M, toks).workers[0]
        assert (s.device_blocks, s.cached_blocks, s.kv_blocks) == (1, 1, n)
        assert calls[0] <= 2 * 17 * n + 4 * n, calls[0]  # two limits x (16 groups + the KV) x n, and the split


def test_runs_of_a_hybrid_worker_apply_like_one_batch_at_a_time() -> None:
    """apply_run (the live ingest's runs) takes a hybrid worker's steady group events in C and stops
    where the layout changes or a clear comes (the pure core's), leaving the same state as applying
    each batch with apply_payload."""
    hs = list(range(1, 25))
    toks = [1 + (i * 7) % 11 for i in range(24 * BS)]

    def swa(a: int, b: int, window: int = 9) -> BlockStored:
        return BlockStored(hs[a:b], hs[a - 1] if a else None, toks[a * BS:b * BS], BS, None, "GPU", group_idx=1,
                           kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=window)

    def kv(a: int, b: int) -> BlockStored:
        return BlockStored(hs[a:b], hs[a - 1] if a else None, toks[a * BS:b * BS], BS, None, "GPU", group_idx=0,
                           kv_cache_spec_kind="full_attention")

    def mamba(i: int) -> BlockStored:
        return BlockStored([hs[i]], hs[i - 1] if i else None, toks[i * BS:(i + 1) * BS], BS, None, "GPU", group_idx=2,
                           kv_cache_spec_kind="mamba")

    batches = [[kv(0, 4), swa(0, 4), mamba(3)]]
    batches += [[kv(a, a + 4), swa(a, a + 4), mamba(a + 3), BlockRemoved(hs[a - 4:a - 2], "GPU", group_idx=1)]
                for a in (4, 8, 12)]
    batches += [[BlockStored(hs[:16], None, [], 0, None, "CPU_PINNED", group_idx=1, kv_cache_spec_kind="sliding_window",
                             kv_cache_spec_sliding_window=9)]]
    batches += [[AllBlocksCleared(), kv(0, 8), swa(0, 8), mamba(7)]]
    batches += [[kv(8, 12), swa(8, 12, window=17)]]  # another window: a layout change, reset
    batches += [[kv(0, 12), swa(0, 12, window=17), mamba(11)], [BlockRemoved(hs[:3], "GPU", group_idx=2)]]
    payloads = [encode_batch(KVEventBatch(float(i + 1), b)) for i, b in enumerate(batches)]
    one, run = _index("native"), _index("native")
    for ix in (one, run):
        ix.apply_payload(M, "w", 0, payloads[0], rank_from_batch=True)
    for p in payloads[1:]:
        one.apply_payload(M, "w", 0, p, rank_from_batch=True)
    rest, applied = payloads[1:], 0
    while rest:
        k, _, extra = run.apply_run(M, "w", 0, 0, rest)
        applied += k
        if extra is not None:
            k += 1
        elif k == 0:
            run.apply_payload(M, "w", 0, rest[0], rank_from_batch=True)
            k = 1
        rest = rest[k:]
    assert applied >= 3  # the steady batches went through the C run
    q = toks[: 12 * BS]
    assert run.score(M, q) == one.score(M, q)
    assert run.dump(M) == one.dump(M)
