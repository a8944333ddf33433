"""Hybrid batches on the C walk (indexer/_native/groups_apply.c): vLLM-shaped batches (a request's KV,
its sliding window with the blocks that left it, Mamba states) from several workers applied by the
accelerator without the pure core — each worker's layout learnt in the walk (groups.learn_store), a
group store's repeated hashes and tokens shared with the KV store of the batch, whose keys it reads —
and held to the pure core: per-batch stats, scores, tier counts and dumps. Plus the batches where the
shortcuts must not apply (a main-tree event between the KV store and the group store, other tokens,
repeated hashes), and the layout changes that stay the pure core's."""
from __future__ import annotations

import random
from typing import Any

import pytest

import indexer.core.accel as accel_mod
from indexer.index import KVIndex
from schemas.codec import encode_batch
from schemas.events import BlockRemoved, BlockStored, KVEventBatch

BS = 4
M = "m"
WINDOW = 3 * BS + 1  # a window of 3 blocks


def _pair() -> tuple[KVIndex, KVIndex]:
    out = []
    for native in (True, False):
        ix = KVIndex(native=native, orphan_grace_batches=0)
        ix.ensure_model(M, BS)
        out.append(ix)
    assert out[0].native and not out[1].native
    return out[0], out[1]


def _request(rng: random.Random, doc: int, toks: list[int], hs: list, chunk: int) -> list[list]:
    """One request's batches, chunk by chunk: KV (group 0), window (group 1) and its out-of-window
    removes, a Mamba state (group 2) at every third block and at the end."""
    n = len(hs)
    out = []
    span = 3
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        parent = hs[a - 1] if a else None
        t = toks[a * BS:b * BS]
        evs: list = [
            BlockStored(hs[a:b], parent, t, BS, None, "GPU", group_idx=0, kv_cache_spec_kind="full_attention"),
            BlockStored(hs[a:b], parent, t, BS, None, "GPU", group_idx=1, kv_cache_spec_kind="sliding_window",
                        kv_cache_spec_sliding_window=WINDOW),
        ]
        evs += [BlockStored([hs[i]], hs[i - 1] if i else None, toks[i * BS:(i + 1) * BS], BS, None, "GPU",
                            group_idx=2, kv_cache_spec_kind="mamba") for i in range(a, b) if i % 3 == 2 or i == n - 1]
        if b - span > 0:
            evs.append(BlockRemoved(hs[max(0, a - span):b - span], "GPU", group_idx=1))
        out.append(evs)
    return out


def _stream(seed: int) -> tuple[list[tuple[str, list]], list[list[int]]]:
    rng = random.Random(seed)
    docs = [[rng.randrange(50) for _ in range(BS * rng.randint(2, 12))] for _ in range(6)]
    out = []
    for d, toks in enumerate(docs):
        n = len(toks) // BS
        hs: list = [10_000 * (d + 1) + i for i in range(n)]
        if d % 3 == 2:
            hs = [h.to_bytes(32, "big") for h in hs]
        for wid in rng.sample(["a", "b", "c", "d"], 2):
            out += [(wid, evs) for evs in _request(rng, d, toks, hs, rng.choice([2, 4, 16]))]
    return out, docs


def _same(nat: KVIndex, pure: KVIndex, docs: list[list[int]]) -> None:
    for toks in docs:
        for q in (toks, toks[: len(toks) // 2], toks + [7] * BS):
            assert nat.score(M, q) == pure.score(M, q)
    assert nat.worker_stats(M) == pure.worker_stats(M)
    backs = []
    for ix in (nat, pure):  # dumps list blocks in map order: compared by what they load back to
        back = KVIndex(native=False)
        back.load_dump(M, BS, ix.dump(M))
        backs.append(back)
    assert backs[0].worker_stats(M) == backs[1].worker_stats(M)
    for toks in docs:
        assert backs[0].score(M, toks) == backs[1].score(M, toks) == pure.score(M, toks)


@pytest.mark.parametrize("seed", range(6))
def test_hybrid_batches_apply_in_c_and_match_the_pure_core(monkeypatch, seed: int) -> None:
    pure_calls = []
    real = accel_mod.apply_events
    monkeypatch.setattr(accel_mod, "apply_events", lambda *a, **kw: (pure_calls.append(a), real(*a, **kw))[1])
    nat, pure = _pair()
    hist, docs = _stream(seed)
    for wid, evs in hist:
        payload = encode_batch(KVEventBatch(0.0, evs))
        assert nat.apply_payload(M, wid, 0, payload) == pure.apply_payload(M, wid, 0, payload)
    assert pure_calls == []  # every batch, each worker's first included, was the C walk's
    _same(nat, pure, docs)


@pytest.mark.parametrize("seed", range(3))
def test_hybrid_runs_apply_in_c_and_match_the_pure_core(seed: int) -> None:
    """apply_run (the service's ingest): a worker's consecutive batches in one call, its layout learnt
    in the first and carried to the next."""
    nat, pure = _pair()
    hist, docs = _stream(seed)
    in_runs = 0
    i = 0
    while i < len(hist):
        wid = hist[i][0]
        j = i
        while j < len(hist) and hist[j][0] == wid:
            j += 1
        payloads = [encode_batch(KVEventBatch(float(k + 1), evs)) for k, (_, evs) in enumerate(hist[i:j])]
        for p in payloads:
            pure.apply_payload(M, wid, 0, p, rank_from_batch=True)
        while payloads:
            k, _, extra = nat.apply_run(M, wid, 0, 0, payloads)
            in_runs += k
            if extra is not None:
                k += 1  # payloads[k] was finished by the pure core
            elif k == 0:  # the caller's one-by-one way (a worker not registered yet)
                nat.apply_payload(M, wid, 0, payloads[0], rank_from_batch=True)
                k = 1
            payloads = payloads[k:]
        i = j
    assert in_runs > len(hist) // 2
    _same(nat, pure, docs)


H = [501, 502, 503, 504]
T = list(range(1, 17))


def _kv(hs=H, toks=T, parent=None) -> BlockStored:
    return BlockStored(hs, parent, toks, BS, None, "GPU", group_idx=0, kv_cache_spec_kind="full_attention")


def _swa(hs=H, toks=T, parent=None) -> BlockStored:
    return BlockStored(hs, parent, toks, BS, None, "GPU", group_idx=1, kv_cache_spec_kind="sliding_window",
                       kv_cache_spec_sliding_window=WINDOW)


@pytest.mark.parametrize("batches", [
    # the KV's blocks removed between the KV store and the window's: the window's own tokens give
    # those blocks' keys (other tokens here: other keys than the KV store's)
    [[_kv([901], T[:4]), _swa([901], T[:4])], [_kv(), BlockRemoved(H, "GPU", group_idx=0), _swa(H, [9] * 16)]],
    [[_kv([901], T[:4]), _swa([901], T[:4])], [_kv(), BlockRemoved(H[:2], "GPU", group_idx=0), _swa(H, [9] * 16)]],
    [[_kv(), _swa()], [_kv([601, 602]), BlockRemoved([601], "GPU"), _swa([601, 602], T[:8])]],
    # the same hashes with other tokens, a KV store of other blocks between, a repeated hash
    [[_kv(), _swa(H, [9] * 16)]],
    [[_kv(), _kv([701, 702], T[:8]), _swa()]],
    [[_kv([801, 802, 801], T[:12]), _swa([801, 802, 801], T[:12])]],
    # the window's map already holds the blocks (keyed from other tokens) when the KV store and the
    # window store of the same blocks come: the window keeps its own keys (all blocks, or some)
    [[_kv([901], T[:4]), _swa([901], T[:4])], [_swa(H, [9] * 16, parent=901)],
     [_kv(H, T, parent=901), _swa(H, T, parent=901)]],
    [[_kv([901], T[:4]), _swa([901], T[:4])], [_swa(H[:2], [9] * 8, parent=901)],
     [_kv(H, T, parent=901), _swa(H, T, parent=901)]],
    # window blocks in neither map: their keys hashed from a parent in the KV map, in the window's
    # map, or in none (group_orphan: nothing stored)
    [[_kv(), _swa([601, 602], T[:8], parent=504)]],
    [[_kv(), _swa(), BlockRemoved(H, "GPU", group_idx=0), _swa([601, 602], T[:8], parent=504)]],
    [[_kv(), _swa([601, 602], T[:8], parent=999)]],
    # the window's store before the KV store of its blocks (hashed from the parent's key): the KV
    # store's equal token bytes share the digests the window's store read
    [[_kv(), _swa()], [_swa([601, 602], T[:8], parent=504), _kv([601, 602], T[:8], parent=504)]],
    [[_kv()], [_swa([601, 602], T[:8], parent=504), _kv([601, 602], T[:8], parent=504), _swa([601, 602], T[:8], parent=504)]],
    # a placeholder KV store (host tier) then the window's placeholder
    [[_kv(), _swa()], [BlockStored(H, None, [], 0, None, "CPU_PINNED", group_idx=0, kv_cache_spec_kind="full_attention"),
                       BlockStored(H, None, [], 0, None, "CPU_PINNED", group_idx=1, kv_cache_spec_kind="sliding_window",
                                   kv_cache_spec_sliding_window=WINDOW)]],
    # layout changes the walk leaves to the pure core: another window for group 1 (a reset), a first
    # store in a group before any KV (its main tree unknown)
    [[_kv(), _swa()], [_kv(), BlockStored(H, None, T, BS, None, "GPU", group_idx=1, kv_cache_spec_kind="sliding_window",
                                          kv_cache_spec_sliding_window=99)]],
    [[_swa(), _kv()], [_kv(), _swa()]],
], ids=["kv-removed", "kv-removed-some", "kv-removed-2", "other-tokens", "kv-between", "repeated-hash",
        "window-mapped-first", "window-mapped-first-some",
        "parent-in-kv", "parent-in-window", "parent-unknown", "window-before-kv", "window-before-kv-2", "placeholders", "reset", "group-first"])
def test_group_store_shortcuts_hold_to_the_pure_core(batches: list[list[Any]]) -> None:
    nat, pure = _pair()
    for wid in ("w", "x"):  # x: its first layout learnt in the walk once the model has groups
        for evs in batches:
            payload = encode_batch(KVEventBatch(0.0, evs))
            assert nat.apply_payload(M, wid, 0, payload) == pure.apply_payload(M, wid, 0, payload)
    _same(nat, pure, [T, T[:8]])


@pytest.mark.parametrize("n", [5, 130, 700])
def test_group_store_growing_its_map_mid_event_holds_to_the_pure_core(monkeypatch, n: int) -> None:
    """A window store of n new blocks with repeated hashes: the group's map grows (rehashes) while the
    event is written, so the slots the first pass kept go stale (the write probes again), and a hash
    seen earlier in the same event is written twice, as the pure core does. Above 128 blocks the
    keys, slots and flags live on the heap."""
    pure_calls = []
    real = accel_mod.apply_events
    monkeypatch.setattr(accel_mod, "apply_events", lambda *a, **kw: (pure_calls.append(a), real(*a, **kw))[1])
    rng = random.Random(n)
    hs = [9_000 + i for i in range(n)]
    rep = hs + [hs[rng.randrange(n)] for _ in range(3)] + [hs[0]]
    toks = [rng.randrange(50) for _ in range(BS * len(rep))]
    nat, pure = _pair()
    for wid in ("w", "x"):
        for evs in (
            [_kv(rep, toks), _swa(rep, toks)],  # the window store's keys read from the KV store's
            [_swa(rep, toks[::-1])],  # other tokens: keys from the group's map and the KV map
            [BlockRemoved(hs[: n // 2], "GPU", group_idx=1), _swa(rep, toks)],  # half re-inserted
        ):
            payload = encode_batch(KVEventBatch(0.0, evs))
            assert nat.apply_payload(M, wid, 0, payload) == pure.apply_payload(M, wid, 0, payload)
    assert pure_calls == []  # every event was the C walk's
    _same(nat, pure, [toks, toks[: BS * (n // 2)]])

