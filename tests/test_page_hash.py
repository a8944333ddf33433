"""The C page-hash helper against the pure-Python reference: same digests, same ids, same errors
(docs/producer-events.md). `make test` fails when the helper was not built, unless
KVATLAS_ALLOW_PURE_PYTHON=1 accepts the slower fallback."""
from __future__ import annotations

import array
import hashlib
import os
import random

import pytest
import xxhash

from producer import page_hash as ph
from sim.driver import Driver, StreamSpec, build_cache, synthetic_stream
from producer.events import EventRecorder
from schemas.codec import encode_batch
from schemas.events import KVEvent, KVEventBatch
from support.sinks import BytesSink

ENV_ALLOW = "KVATLAS_ALLOW_PURE_PYTHON"
native = ph._native  # None when not built; every comparison below then says so


def test_native_page_hash_is_built() -> None:
    if os.environ.get(ENV_ALLOW, "") not in ("", "0"):
        return  # explicitly accepted: hashlib serves (same results, slower)
    assert ph.native_available(), (
        f"the producer's page-hash helper is not built ({ph.native_unavailable_reason()}); rebuild with "
        f"`pip install -e .` (needs a C compiler and Python headers) or set {ENV_ALLOW}=1"
    )


def _native_fns():
    if native is None:
        pytest.fail("producer._native._pagehash is not built (see test_native_page_hash_is_built)")
    return [native.sha256_chain, native.sha256_chain_library]


def _cases(seed: int, n: int):
    rng = random.Random(seed)
    for _ in range(n):
        page = rng.choice([1, 2, 3, 4, 7, 16, 32, 64])
        ntok = rng.choice([0, 1, page - 1, page, page + 1, rng.randrange(0, 400)])
        tokens = [rng.choice([0, 1, 2**31, 2**32 - 1, rng.randrange(2**32), rng.randrange(32000)])
                  for _ in range(max(0, ntok))]
        # Prior lengths around the SHA-256 padding boundaries, empty (= none) and None.
        plen = rng.choice([None, 0, 1, 16, 32, 55, 56, 63, 64, 65, 119, 120, 200])
        prior = None if plen is None else bytes(rng.randrange(256) for _ in range(plen))
        yield tokens, page, prior


def test_sha256_native_equals_reference_on_random_inputs() -> None:
    fns = _native_fns()
    for tokens, page, prior in _cases(1, 400):
        want = ph.py_sha256_ids(tokens, page, prior)
        for fn in fns:
            assert fn(tokens, page, prior) == want
            assert fn(tuple(tokens), page, prior) == want
            assert fn(array.array("I", tokens).tobytes(), page, prior) == want  # u32 LE buffer
        assert ph.py_sha256_ids(array.array("I", tokens).tobytes(), page, prior) == want


def test_sha256_matches_hashlib_directly() -> None:
    # Independent of the reference's chaining code: page i = sha256(prior || u32le page).
    tokens = list(range(1, 13))
    prior = None
    want = []
    for i in range(3):
        h = hashlib.sha256((prior or b"") + array.array("I", tokens[4 * i:4 * i + 4]).tobytes()).digest()
        want.append(h)
        prior = h
    for fn in _native_fns():
        digests, ids = fn(tokens, 4)
        assert digests == want
        assert ids == [int.from_bytes(d[:8], "big", signed=True) for d in want]


def test_xxh3_native_equals_reference() -> None:
    if native is None:
        pytest.fail("producer._native._pagehash is not built")
    for tokens, page, prior in _cases(2, 200):
        assert native.call_chain(xxhash.xxh3_128_digest, tokens, page, prior) == ph.py_xxh3_ids(tokens, page, prior)


@pytest.mark.parametrize("name", ["sha256", "xxh3"])
def test_selected_functions_agree(name: str) -> None:
    tokens = list(range(100))
    assert ph.page_hash_chain_ids(name, native=True)(tokens, 16, None) == \
        ph.page_hash_chain_ids(name, native=False)(tokens, 16, None)


@pytest.mark.parametrize("bad, exc", [
    ([1, 2, 2**32, 4], OverflowError),        # huge id
    ([1, -1, 3, 4], OverflowError),           # negative id
    ([1, 2**70, 3, 4], OverflowError),        # beyond 64 bits
    ([1, "x", 3, 4], TypeError),              # not an int
])
def test_errors_are_the_same(bad: list, exc: type) -> None:
    with pytest.raises(exc):
        ph.py_sha256_ids(bad, 4)
    for fn in _native_fns():
        with pytest.raises(exc):
            fn(bad, 4)
    with pytest.raises(exc):
        native.call_chain(xxhash.xxh3_128_digest, bad, 4)  # type: ignore[union-attr]


def test_partial_trailing_page_is_never_read() -> None:
    # Only whole pages are hashed, so a bad id in the partial tail is ignored by both.
    tokens = [1, 2, 3, 4, 2**40]
    want = ph.py_sha256_ids(tokens, 4)
    assert len(want[0]) == 1
    for fn in _native_fns():
        assert fn(tokens, 4) == want


def test_bad_arguments() -> None:
    for fn in [*_native_fns(), ph.py_sha256_ids]:
        with pytest.raises(ValueError):
            fn([1, 2, 3], 0)
        with pytest.raises(ValueError):
            fn(b"\x00\x00\x00", 1)  # a buffer of u32 must be a multiple of 4 bytes
        assert fn([], 4) == ([], [])
    with pytest.raises(TypeError):
        native.sha256_chain([1, 2, 3, 4], 4, 12)  # type: ignore[union-attr]
    with pytest.raises(TypeError):
        native.call_chain(lambda b: 7, [1, 2, 3, 4], 4)  # type: ignore[union-attr]
    with pytest.raises(TypeError):
        native.call_chain(lambda b: b"short", [1, 2, 3, 4], 4)  # type: ignore[union-attr]


def test_large_insert_hashes_with_gil_released() -> None:
    tokens = [random.Random(3).randrange(2**32) for _ in range(16 * 600)]
    for fn in _native_fns():
        assert fn(tokens, 16) == ph.py_sha256_ids(tokens, 16)


class ObjectBytesSink(BytesSink):
    """Encodes like BytesSink but declares it reads events: gets plain token-id lists."""

    __slots__ = ()
    encodes_events = False


@pytest.mark.parametrize("page_hash", ["sha256", "xxh3"])
def test_cache_events_are_byte_identical_native_or_pure(page_hash: str) -> None:
    """The whole event stream of a cache under eviction pressure: native vs pure hashing, token
    ids packed by the C helper vs msgspec, pre-encoded vs plain lists — the same bytes."""
    _native_fns()
    spec = StreamSpec(requests=120, prefixes=6, prefix_tokens=128, suffix_tokens=40, seed=5)
    payloads = []
    for nat, sink in ((True, BytesSink()), (False, BytesSink()), (True, ObjectBytesSink())):
        rec = EventRecorder(sink, heartbeat_interval_s=3600.0, native=nat)
        cache = build_cache(page_size=16, device_pages=64, recorder=rec, page_shape=(1,), page_hash=page_hash)
        cache.tree.chain_blob = ph.page_hash_chain_blob(page_hash, native=nat)
        Driver(cache, fill=False, lookahead=0).run(synthetic_stream(spec))
        payloads.append(sink.payloads)
    assert payloads[0] == payloads[1] == payloads[2]
    assert len(payloads[0]) > 50


def test_native_batch_encode_is_msgspec_bytes() -> None:
    """The C event encoder (`Batch`, the one encoder path) writes exactly msgspec's bytes for
    KVEventBatch: every event kind, optional fields set or omitted, ints of every width, arrays and
    strings across their size classes, ids as ints or digests, dp_rank None or set. What it does
    not take raises before the batch changes (the recorder then lets msgspec encode)."""
    from schemas.events import AllBlocksCleared, BlockRemoved, BlockStored

    if native is None:
        pytest.fail("producer._native._pagehash is not built")
    edges = [0, 1, 31, 32, 127, 128, 255, 256, 65535, 65536, 2**30 - 1, 2**30, 2**31, 2**32 - 1, 2**32,
             2**63 - 1, 2**63, 2**64 - 1, -1, -32, -33, -128, -129, -32768, -32769, -2**31, -2**31 - 1, -2**63]
    rng = random.Random(11)

    def ints(n: int) -> list[int]:
        return [rng.choice(edges) if rng.random() < 0.5 else rng.randrange(-2**63, 2**63) for _ in range(n)]

    def opt(v):  # noqa: ANN001, ANN202
        return v if rng.random() < 0.5 else None

    def ids_given(n: int):  # noqa: ANN202 - (ids as ints, None, 0) or (ids, digests, dlen)
        if rng.random() < 0.5:
            return ints(n), None, 0
        dlen = rng.choice([16, 32])
        digests = bytes(rng.randrange(256) for _ in range(n * dlen))
        return ph._py_ids_of(digests, dlen), digests, dlen

    for case in range(300):
        b, events = native.Batch(), []
        for _ in range(rng.randrange(0, 6)):
            k = rng.randrange(3)
            if k == 0:
                n = rng.choice([0, 1, 15, 16, 17, 300]) if case != 7 else 70000  # > 65535: array32
                toks = [rng.choice(edges[:14]) if rng.random() < 0.5 else rng.randrange(2**32) for _ in range(n)]
                ids, digests, dlen = ids_given(rng.choice([1, 15, 16, 40]))
                parent = opt(rng.choice(edges))
                # a parent no stored event ends with: each store is its own event, as msgspec's
                if events and type(events[-1]) is BlockStored and parent == events[-1].block_hashes[-1]:
                    parent = None
                f = (rng.choice([1, 16, 2**20]), rng.choice(["GPU", "CPU_PINNED", "x" * 40]),
                     opt(rng.choice([0, 1, 300])), opt(rng.choice(["full_attention", "y" * 300])),
                     opt(rng.choice([128, 70000])))
                if digests is None:
                    b.stored_ids(ids, parent, tuple(toks) if rng.random() < 0.5 else toks, *f)
                else:
                    b.stored_digests(digests, dlen, parent, tuple(toks), *f)
                events.append(BlockStored(ids, parent, toks, f[0], None, f[1], group_idx=f[2],
                                          kv_cache_spec_kind=f[3], kv_cache_spec_sliding_window=f[4]))
            elif k == 1:
                ids, digests, dlen = ids_given(rng.choice([1, 16, 17]))
                m, g = rng.choice(["GPU", "DISK"]), opt(rng.choice([0, 5]))
                if digests is None:
                    b.removed_ids(ids, m, g)
                else:
                    b.removed_digests(digests, dlen, m, g)
                last = events[-1] if events else None
                if type(last) is BlockRemoved and (last.medium, last.group_idx) == (m, g):
                    last.block_hashes.extend(ids)  # a removal of the same tier and group coalesces
                else:
                    events.append(BlockRemoved(ids, m, group_idx=g))
            else:
                b.cleared()
                events.append(AllBlocksCleared())
        ts, dp = rng.choice([0.0, 1.5e9 + rng.random(), -3.25]), rng.choice([None, 0, 3])
        assert len(b) == len(events)
        assert b.take(ts, dp) == encode_batch(KVEventBatch(ts, events, dp))
    b = native.Batch()
    b.stored_ids([7], None, (1, 2), 2, "GPU", None, None, None)
    for call in (lambda: b.stored_ids([2**64], None, (1,), 16, "GPU", None, None, None),
                 lambda: b.stored_ids([1], None, (True,), 16, "GPU", None, None, None),
                 lambda: b.stored_ids([1], None, (1.5,), 16, "GPU", None, None, None),
                 lambda: b.stored_digests(bytes(31), 32, None, (1,), 16, "GPU", None, None, None),
                 lambda: b.removed_ids([b"raw"], "GPU", None),
                 lambda: b.removed_ids([1], 5, None)):
        with pytest.raises((TypeError, OverflowError)):
            call()
    assert b.take(0.0, None) == encode_batch(KVEventBatch(0.0, [BlockStored([7], None, [1, 2], 2, None, "GPU")]))


def test_recorder_falls_back_to_msgspec_for_what_the_encoder_declines() -> None:
    """Token ids the C encoder does not take (a bool from a caller) still go out, as msgspec's bytes."""
    from schemas.media import Medium

    sink = BytesSink()
    rec = EventRecorder(sink)
    rec.stored([5], None, (True, 2), 2, Medium.GPU)
    rec.flush(0.0)
    assert sink.payloads == [encode_batch(KVEventBatch(0.0, [rec_event_stored([5], None, [True, 2], 2)], None))]


def rec_event_stored(ids: list, parent, tokens: list, size: int):  # noqa: ANN001, ANN201
    from schemas.events import BlockStored

    return BlockStored(ids, parent, tokens, size, None, "GPU")


@pytest.mark.parametrize("nat", [True, False])
def test_recorder_digest_ids_match_int_ids(nat: bool) -> None:
    """Stores and removals given as digest blobs coalesce and encode exactly like the same ids
    given as ints — mixed in one record too — for a sink that reads events and one that sends bytes."""
    from producer.sinks import ListSink
    from schemas.media import Medium

    tokens = tuple(range(100, 100 + 8 * 4))
    blob = ph.page_hash_chain_blob("sha256", native=nat)(tokens, 4, None)
    ids = ph.ids_of(blob, 32)
    assert ids == ph.py_sha256_ids(tokens, 4)[1]

    def feed(rec: EventRecorder, as_blob: bool) -> None:
        cut = 3 * 32
        if as_blob:
            rec.stored_digests(blob[:cut], 32, None, tokens[:12], 4, Medium.GPU)
            rec.stored(ids[3:5], ids[2], tokens[12:20], 4, Medium.GPU)           # ints continue a blob record
            rec.stored_digests(blob[5 * 32:], 32, ids[4], tokens[20:], 4, Medium.GPU)
            rec.removed_digests(blob[:cut], 32, Medium.GPU)
            rec.removed(ids[3:], Medium.GPU)
            rec.stored_digests(blob[:32], 32, None, tokens[:4], 4, Medium.CPU_PINNED, group_idx=0, kind="full")
        else:
            rec.stored(ids[:3], None, tokens[:12], 4, Medium.GPU)
            rec.stored(ids[3:5], ids[2], tokens[12:20], 4, Medium.GPU)
            rec.stored(ids[5:], ids[4], tokens[20:], 4, Medium.GPU)
            rec.removed(ids[:3], Medium.GPU)
            rec.removed(ids[3:], Medium.GPU)
            rec.stored(ids[:1], None, tokens[:4], 4, Medium.CPU_PINNED, group_idx=0, kind="full")
        rec.flush(0.0)

    out = []
    for as_blob in (True, False):
        lsink, bsink = ListSink(), BytesSink()
        feed(EventRecorder(lsink, native=nat), as_blob)
        feed(EventRecorder(bsink, native=nat), as_blob)
        out.append(([(type(e).__name__, e.block_hashes) for e in lsink.events()], bsink.payloads))
    assert out[0] == out[1]
    assert out[0][0] == [("BlockStored", ids), ("BlockRemoved", ids), ("BlockStored", ids[:1])]
