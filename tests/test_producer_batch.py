"""The recorder's native `Batch` (events msgpack-encoded as they are recorded, a new node hashed
and stored in one call) against the pure-Python recorder: the same bytes on the wire for any
sequence of records, the same coalescing, the same errors (docs/producer-events.md)."""
from __future__ import annotations

import array
import hashlib
import random

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer import page_hash as ph
from sim.driver import Driver, StreamSpec, build_cache, synthetic_stream
from producer.events import EventRecorder
from producer.sinks import _PayloadSink
from schemas.codec import encode_batch
from support.sinks import BytesSink
from schemas.events import BlockStored, KVEventBatch
from schemas.media import Medium

native = ph._native


def _mod():
    if native is None:
        pytest.fail("producer._native._pagehash is not built (see tests/test_page_hash.py)")
    return native


TS = 12.5  # the batches' fixed timestamp (support.sinks.BytesSink)


# Ints across msgpack's width classes (and u32's edge), for ids and token ids.
_EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**31, 2**32 - 1]
_ID_EDGES = _EDGES + [2**32, 2**63 - 1, 2**63, 2**64 - 1, -1, -32, -33, -128, -129, -2**31, -2**63]
token = st.one_of(st.sampled_from(_EDGES), st.integers(0, 2**32 - 1))
block_id = st.one_of(st.sampled_from(_ID_EDGES), st.integers(-2**63, 2**64 - 1))
medium = st.sampled_from([Medium.GPU, Medium.CPU_PINNED, Medium.DISK])
group = st.sampled_from([None, 0, 3])
kind = st.sampled_from([None, "full_attention", "sliding_window"])
window = st.sampled_from([None, 128])


@st.composite
def operations(draw: st.DrawFn) -> list[tuple]:
    """Records as a cache makes them: stores that often continue the previous store's chain (so
    they coalesce), removals, clears, flushes; now and then a value the batch declines."""
    ops: list[tuple] = []
    last: list[int] = []
    prev = (1, Medium.GPU, None, None, None)  # the previous store's page size, medium, group, kind, window
    for _ in range(draw(st.integers(0, 14))):
        k = draw(st.sampled_from(["stored", "stored", "stored_digests", "stored_digests", "removed",
                                  "removed_digests", "cleared", "flush"]))
        if k in ("stored", "stored_digests"):
            # Mostly the previous store's fields (so a continued chain coalesces), with one of
            # them changed now and then (so it must not).
            fields = list(prev)
            if draw(st.booleans()):
                fields = [draw(st.sampled_from([1, 2, 4])), draw(medium), draw(group), draw(kind), draw(window)]
            else:
                i = draw(st.integers(0, 9))
                if i < 5:
                    fields[i] = draw([st.sampled_from([1, 2, 4]), medium, group, kind, window][i])
            prev = tuple(fields)
            page, extra = fields[0], tuple(fields[1:])
            n = draw(st.integers(1, 4))
            toks = draw(st.lists(token, min_size=n * page, max_size=n * page))
            if draw(st.integers(0, 30)) == 0:
                toks[0] = True  # a bool: the batch declines it, msgspec writes `true`
            parent = draw(st.one_of(st.sampled_from(last[-1:] or [None]), st.none(), block_id))
            if k == "stored":
                ids = draw(st.lists(block_id, min_size=n, max_size=n))
                ops.append((k, ids, parent, tuple(toks), page, *extra))
                last = ids
            else:
                dlen = draw(st.sampled_from([16, 32]))
                digests = draw(st.binary(min_size=n * dlen, max_size=n * dlen))
                ops.append((k, digests, dlen, parent, tuple(toks), page, *extra))
                last = ph._py_ids_of(digests, dlen)
        elif k == "removed":
            ops.append((k, draw(st.lists(block_id, min_size=1, max_size=3)), draw(medium), draw(group)))
        elif k == "removed_digests":
            dlen = draw(st.sampled_from([16, 32]))
            n = draw(st.integers(1, 3))
            ops.append((k, draw(st.binary(min_size=n * dlen, max_size=n * dlen)), dlen, draw(medium), draw(group)))
        else:
            ops.append((k,))
    return ops


def _play(ops: list[tuple], nat: bool) -> list[bytes]:
    sink = BytesSink(TS)
    rec = EventRecorder(sink, heartbeat_interval_s=3600.0, native=nat)
    assert (rec.batch is not None) == nat
    for op in ops:
        k = op[0]
        if k == "stored":
            _, ids, parent, toks, page, m, g, kd, w = op
            rec.stored(ids, parent, toks, page, m, group_idx=g, kind=kd, window=w)
        elif k == "stored_digests":
            _, digests, dlen, parent, toks, page, m, g, kd, w = op
            rec.stored_digests(digests, dlen, parent, toks, page, m, group_idx=g, kind=kd, window=w)
        elif k == "removed":
            rec.removed(op[1], op[2], group_idx=op[3])
        elif k == "removed_digests":
            rec.removed_digests(op[1], op[2], op[3], group_idx=op[4])
        elif k == "cleared":
            rec.cleared()
        else:
            rec.flush(1.0)
    pending = rec.pending
    assert rec.flush(2.0) == pending
    return sink.payloads


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations())
def test_native_batch_bytes_equal_python_records(ops: list[tuple]) -> None:
    """Any sequence of records: the native batch sends exactly the pure-Python recorder's bytes
    (msgspec's), with the same coalescing and the same event counts."""
    _mod()
    assert _play(ops, True) == _play(ops, False)


# How stored_chain is told the page digest: SHA-256 and XXH3-128 built in, or any function.
DIGESTS = {"sha256": None, "xxh3": "xxh3", "xxh3-call": xxhash.xxh3_128_digest}


def _spec(name: str, page: int, medium: str = "GPU", group_idx=None, kind=None, window=None) -> tuple:  # noqa: ANN001
    return (DIGESTS[name], ph.DIGEST_LEN[name.split("-")[0]], page, page, medium, group_idx, kind, window)


_XXH3_LENGTHS = [0, 1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 80, 96, 97, 127, 128, 129, 159, 160, 161,
                 191, 192, 239, 240, 241, 255, 256, 1023, 1024, 1025, 1088, 2047, 2048, 4096, 10000]


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.binary(max_size=300), st.binary(min_size=300, max_size=5000),
                 st.sampled_from(_XXH3_LENGTHS).map(lambda n: bytes(range(256)) * (n // 256) + bytes(range(n % 256)))))
def test_builtin_xxh3_equals_xxhash(data: bytes) -> None:
    """The helper's own XXH3-128 (every length class: 0, 1-3, 4-8, 9-16, 17-128, 129-240, long
    with whole and partial stripes and blocks) against the xxhash package."""
    assert _mod().xxh3_128(data) == xxhash.xxh3_128_digest(data)


def test_builtin_xxh3_chain_equals_reference() -> None:
    mod = _mod()
    rng = random.Random(5)
    for _ in range(200):
        page = rng.choice([1, 2, 3, 4, 16, 28, 29, 56, 57, 64, 300])
        toks = [rng.randrange(2**32) for _ in range(page * rng.randrange(0, 12) + rng.randrange(page))]
        prior = rng.choice([None, b"", rng.randbytes(16), rng.randbytes(5)])
        want = ph.py_xxh3_ids(toks, page, prior)
        assert mod.xxh3_blob(toks, page, prior) == b"".join(want[0])
        assert ph.page_hash_chain_ids("xxh3", native=True)(toks, page, prior) == want
    with pytest.raises(OverflowError):
        mod.xxh3_blob([1, 2**32], 1)


@pytest.mark.parametrize("name", ["sha256", "xxh3", "xxh3-call"])
def test_stored_chain_equals_hash_then_store(name: str) -> None:
    """`Batch.stored_chain` returns the reference chain's digests and records the store that
    hashing first and recording the digests gives: every page size (64-byte pages take their own
    SHA path), parents of one or several digests, token ids of every width."""
    mod = _mod()
    ref = ph.py_sha256_ids if name == "sha256" else ph.py_xxh3_ids
    dlen = ph.DIGEST_LEN[name.split("-")[0]]
    rng = random.Random(7)
    for _ in range(300):
        page = rng.choice([1, 2, 3, 7, 15, 16, 17, 32, 56, 57, 64])
        toks = tuple(rng.choice(_EDGES) if rng.random() < 0.3 else rng.randrange(2**32)
                     for _ in range(page * rng.randrange(1, 30)))
        parent = rng.choice([None, rng.randbytes(dlen), rng.randbytes(3 * dlen)])
        prior = parent[-dlen:] if parent else None
        g, kd = rng.choice([(None, None), (0, "full_attention")])
        b = mod.Batch()
        blob = b.stored_chain(toks, parent, _spec(name, page, "CPU_PINNED", g, kd))
        digests, ids = ref(toks, page, prior)
        assert blob == b"".join(digests)
        pid = int.from_bytes(prior[:8], "big", signed=True) if prior else None
        want = BlockStored(ids, pid, list(toks), page, None, "CPU_PINNED", group_idx=g, kv_cache_spec_kind=kd)
        assert b.take(1.0, 2) == encode_batch(KVEventBatch(1.0, [want], 2))
        # the same store given as digests, through the other entry point
        b.stored_digests(blob, dlen, pid, toks, page, "CPU_PINNED", g, kd, None)
        assert b.take(1.0, 2) == encode_batch(KVEventBatch(1.0, [want], 2))


@pytest.mark.parametrize("page", [1, 5, 16])
def test_sha256_chain_matches_hashlib(page: int) -> None:
    """The SHA paths with the message built in registers (pages of 1 and 16 tokens) and the
    general one, against hashlib itself over a chain long enough to hash without the GIL."""
    mod = _mod()
    rng = random.Random(page)
    npages = 300
    toks = tuple(rng.randrange(2**32) for _ in range(page * npages))
    prior = rng.randbytes(32)
    want, d = [], prior
    for i in range(npages):
        d = hashlib.sha256(d + array.array("I", toks[page * i:page * (i + 1)]).tobytes()).digest()
        want.append(d)
    assert mod.Batch().stored_chain(toks, prior, _spec("sha256", page)) == b"".join(want)
    assert mod.sha256_blob(toks, page, prior) == b"".join(want)
    assert mod.sha256_chain_library(toks, page, prior)[0] == want


def test_stored_chain_coalesces_along_the_chain() -> None:
    """A child stored right after its parent (the parent's last digest is its prior) joins the
    parent's store, as the recorder's Python records do."""
    mod = _mod()
    b = mod.Batch()
    toks = tuple(range(1000, 1064))
    spec = _spec("sha256", 16)
    first = b.stored_chain(toks[:32], None, spec)
    second = b.stored_chain(toks[32:], first, spec)
    assert len(b) == 1
    digests, ids = ph.py_sha256_ids(toks, 16)
    assert first + second == b"".join(digests)
    assert b.take(0.0, None) == encode_batch(KVEventBatch(0.0, [BlockStored(ids, None, list(toks), 16, None, "GPU")]))


def test_stored_chain_errors_leave_the_batch_as_it_was() -> None:
    mod = _mod()
    b = mod.Batch()
    spec = _spec("sha256", 4)
    b.stored_chain((1, 2, 3, 4), None, spec)
    before = len(b)
    with pytest.raises(OverflowError):
        b.stored_chain((1, 2, 2**32, 4), None, spec)
    with pytest.raises(TypeError):
        b.stored_chain((1, "x", 3, 4), None, spec)
    with pytest.raises(ValueError):
        b.stored_chain((1, 2, 3, 4), bytes(31), spec)      # not whole digests
    with pytest.raises(ValueError):
        b.stored_chain((1, 2, 3, 4), None, (None, 16, 4, 4, "GPU", None, None, None))  # SHA-256 is 32 bytes
    with pytest.raises(ValueError):
        b.stored_chain((1, 2, 3, 4), None, ("xxh3", 32, 4, 4, "GPU", None, None, None))  # XXH3-128 is 16
    with pytest.raises(TypeError):
        b.stored_chain((1, 2, 3, 4), None, (lambda m: b"short", 8, 4, 4, "GPU", None, None, None))
    with pytest.raises(TypeError):
        b.stored_chain((1, 2, 3, 4), None, spec[:7])
    with pytest.raises(TypeError):
        b.stored_digests(bytes(32), 32, None, (True,), 1, "GPU", None, None, None)  # a bool token
    with pytest.raises(OverflowError):
        b.stored_ids([2**64], None, (1,), 1, "GPU", None, None, None)
    assert len(b) == before
    assert b.stored_chain((1, 2, 3), None, spec) == b"" and len(b) == before  # no whole page: no store
    digests, ids = ph.py_sha256_ids((1, 2, 3, 4), 4)
    assert b.take(0.0, None) == encode_batch(KVEventBatch(0.0, [BlockStored(ids, None, [1, 2, 3, 4], 4, None, "GPU")]))


def test_digest_function_cannot_reenter_its_batch() -> None:
    """While a chain is hashed the batch's buffers are in use: a digest function (or another
    thread) touching the same batch gets an error, never a buffer freed under the hash."""
    mod = _mod()
    b = mod.Batch()

    def digest(msg: bytes) -> bytes:
        b.cleared()
        return hashlib.sha256(msg).digest()

    with pytest.raises(RuntimeError):
        b.stored_chain((1, 2, 3, 4), None, (digest, 32, 4, 4, "GPU", None, None, None))
    assert len(b) == 0


@pytest.mark.parametrize("vocab", [200, 70000, 2**32 - 1])
@pytest.mark.parametrize("page_hash", ["sha256", "xxh3"])
def test_cache_streams_native_batch_equal_pure(page_hash: str, vocab: int) -> None:
    """A cache under eviction, token ids of every width: native batch (stores hashed and
    recorded in one call), pure Python, and the struct path give the same bytes."""
    _mod()
    spec = StreamSpec(requests=60, prefixes=5, prefix_tokens=96, suffix_tokens=40, vocab=vocab, seed=9)

    class ObjectSink(BytesSink):
        __slots__ = ()
        encodes_events = False

    out = []
    for nat, sink in ((True, BytesSink(TS)), (False, BytesSink(TS)), (True, ObjectSink(TS))):
        rec = EventRecorder(sink, heartbeat_interval_s=3600.0, native=nat)
        cache = build_cache(page_size=16, device_pages=40, recorder=rec, page_shape=(1,), page_hash=page_hash)
        cache.tree.chain_blob = ph.page_hash_chain_blob(page_hash, native=nat)
        Driver(cache, fill=False, lookahead=0).run(synthetic_stream(spec))
        cache.emit_snapshot()
        cache.step(0.0)
        out.append(sink.payloads)
    assert out[0] == out[1] == out[2]
    assert len(out[0]) > 30
