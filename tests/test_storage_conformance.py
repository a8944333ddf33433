"""One conformance suite for the three L3 storage backends (`producer.storage`): memory, file and
Redis (a real redis-server from the conftest fixture). Each test states a rule of the
`StorageBackend` protocol every backend must keep; backend-specific behaviour (file layout and
recovery, Redis outages and TTLs, the memory LRU) stays in test_producer_storage.py.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from producer.storage import (
    FileStorageBackend,
    MemoryStorageBackend,
    RedisStorageBackend,
    StorageBackend,
    StorageCapacity,
    backend_medium,
    page_key,
)
from schemas.media import Medium
from support.net import RedisServer

BINARY = bytes(range(256)) * 4  # every byte value, incl. NUL and CR/LF

Factory = Callable[[], StorageBackend]


@pytest.fixture(params=["memory", "file", "redis"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    """A factory of backends of one kind sharing one store (a second instance sees the first's
    writes: the same root, the same Redis prefix); all are closed afterwards."""
    made: list[StorageBackend] = []
    if request.param == "memory":
        shared = MemoryStorageBackend()
        factory: Factory = lambda: shared  # noqa: E731 — a process-local store has one instance
    elif request.param == "file":
        factory = lambda: FileStorageBackend(tmp_path / "l3")  # noqa: E731
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        factory = lambda: RedisStorageBackend(server.url, prefix="conf:")  # noqa: E731

    def build() -> StorageBackend:
        be = factory()
        made.append(be)
        return be

    yield build
    for be in made:
        be.close()


def test_is_a_storage_backend_with_a_consistent_medium(make: Factory) -> None:
    be = make()
    assert isinstance(be, StorageBackend)
    assert isinstance(be.name, str) and be.name
    assert backend_medium(be) is (Medium.EXTERNAL if be.shared else Medium.DISK)


def test_roundtrip_is_binary_exact_for_every_bytes_like_value(make: Factory) -> None:
    be = make()
    keys = [page_key(i) for i in range(5)] + ["unicode-ключ", "x" * 300]
    values = [BINARY, b"", memoryview(b"view-bytes"), bytearray(b"\x00\r\n"), b"u", b"long" * 100, b"h"]
    assert be.set(keys, values) == [True] * len(keys)
    assert be.get(keys) == [bytes(v) for v in values]
    assert all(type(v) is bytes for v in be.get(keys))
    assert be.exists(keys) == [True] * len(keys)


def test_absent_keys_read_as_none_and_false_in_batch_order(make: Factory) -> None:
    be = make()
    assert be.set(["a", "c"], [b"1", b"3"]) == [True, True]
    assert be.get(["a", "b", "c", "d"]) == [b"1", None, b"3", None]
    assert be.exists(["d", "c", "b", "a"]) == [False, True, False, True]


def test_a_second_write_replaces_the_first(make: Factory) -> None:
    be = make()
    assert be.set(["k"], [b"old"]) == [True]
    assert be.set(["k"], [b"newer value"]) == [True]
    assert be.get(["k"]) == [b"newer value"]


def test_delete_counts_what_it_removed_and_is_not_an_eviction(make: Factory) -> None:
    be = make()
    assert be.set(["a", "b", "c"], [b"1", b"2", b"3"]) == [True] * 3
    assert be.delete(["a", "b", "missing"]) == 2
    assert be.delete(["a"]) == 0
    assert be.exists(["a", "b", "c"]) == [False, False, True]
    assert be.drain_evicted() == []


def test_empty_batches_are_empty_answers(make: Factory) -> None:
    be = make()
    assert (be.set([], []), be.get([]), be.exists([]), be.delete([])) == ([], [], [], 0)


@pytest.mark.parametrize(("keys", "values", "match"), [
    ("abc", None, "sequence of str"),
    ([""], None, "non-empty str"),
    ([7], None, "non-empty str"),
    (["a", "b"], [b"1"], "2 keys but 1 values"),
    (["a"], ["text"], "bytes-like"),
])
def test_a_malformed_batch_is_a_clear_error(make: Factory, keys: object, values: object, match: str) -> None:
    be = make()
    calls = [be.get, be.exists, be.delete] if values is None else [lambda k: be.set(k, values)]  # type: ignore[arg-type]
    for call in calls:
        with pytest.raises(ValueError, match=match):
            call(keys)  # type: ignore[arg-type]
    assert be.get(["a"]) == [None]  # nothing half-written


def test_capacity_reports_the_bytes_written(make: Factory) -> None:
    be = make()
    before = be.capacity()
    assert isinstance(before, StorageCapacity)
    big = b"\xab" * (256 * 1024)
    assert be.set(["big0", "big1"], [big, big]) == [True, True]
    after = be.capacity()
    assert after.used_bytes >= before.used_bytes + 2 * len(big) - 64 * 1024  # Redis counts its own memory too
    assert after.limit_bytes is None or after.limit_bytes >= after.used_bytes


def test_a_second_instance_sees_the_same_store(make: Factory) -> None:
    a, b = make(), make()
    assert a.set(["shared-key"], [BINARY]) == [True]
    assert b.get(["shared-key"]) == [BINARY]
    assert b.delete(["shared-key"]) == 1
    assert a.exists(["shared-key"]) == [False]


@pytest.mark.parametrize("seed", range(3))
def test_random_batches_match_a_dict(make: Factory, seed: int) -> None:
    """Any sequence of batched sets, overwrites, deletes and reads (no capacity limit) leaves the
    backend answering exactly like a dict."""
    rng = random.Random(seed)
    be = make()
    model: dict[str, bytes] = {}
    pool = [f"k{i}" for i in range(24)]
    for _ in range(60):
        keys = rng.sample(pool, rng.randint(1, 6))
        op = rng.random()
        if op < 0.5:
            values = [rng.randbytes(rng.randint(0, 48)) for _ in keys]
            assert be.set(keys, values) == [True] * len(keys)
            model.update(zip(keys, values))
        elif op < 0.7:
            assert be.delete(keys) == sum(k in model for k in keys)
            for k in keys:
                model.pop(k, None)
        else:
            assert be.get(keys) == [model.get(k) for k in keys]
            assert be.exists(keys) == [k in model for k in keys]
    assert be.get(pool) == [model.get(k) for k in pool]
    assert be.drain_evicted() == []
