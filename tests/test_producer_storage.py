"""L3 storage: keys, file/memory/Redis backends, the storage worker, backend config parsing.

Redis tests run a real redis-server (the conftest fixture); the kill/restart tests restart it on
the same port with the helper below.
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.storage import (
    FileStorageBackend,
    MemoryStorageBackend,
    RedisStorageBackend,
    StorageBackend,
    StorageCapacity,
    StorageWorker,
    backend_medium,
    hash_hex,
    load_backend_config,
    make_storage_backend,
    page_key,
    page_keys,
    split_key,
)
from producer.storage.file_backend import key_filename
from producer.storage.ledger import LruLedger
from schemas.media import Medium

from support.net import REDIS_BIN, RedisServer, wait_until
from router_api.procs import spawn

BINARY = bytes(range(256)) * 4  # every byte value, incl. NUL and CR/LF


def deadline_poll(fn, timeout: float = 10.0):
    """Return fn() once truthy; fail at the deadline (polls real completion, never sleeps blind)."""
    return wait_until(fn, timeout=timeout, interval=0.002)


# --- keys ------------------------------------------------------------------------------------


def test_page_keys_normalise_hashes_and_suffixes() -> None:
    assert hash_hex(-1) == "f" * 16  # SGLang signed int64 -> same key as its u64 form
    assert hash_hex(-1) == hash_hex(2**64 - 1)
    assert hash_hex(5) == "0000000000000005"
    assert hash_hex(b"\x01\xab") == "01ab"
    assert page_key(5, "mamba") == "0000000000000005.mamba"
    assert page_keys([1, 2]) == ["0000000000000001", "0000000000000002"]
    assert split_key("00ff.dsa") == ("00ff", "dsa")
    assert split_key("00ff") == ("00ff", None)
    for bad in ("a.b", "", "x" * 65, "sp ace"):
        if bad == "":
            assert page_key(1, bad) == hash_hex(1)
            continue
        with pytest.raises(ValueError, match="suffix"):
            page_key(1, bad)
    with pytest.raises(ValueError):
        hash_hex(True)
    with pytest.raises(ValueError):
        hash_hex(b"")


def test_ledger_lru_victims() -> None:
    led = LruLedger(100)
    for k in "abcd":
        led.put(k, 25)
    led.touch("a")  # b is now the oldest
    assert led.victims(30) == ["b", "c"]
    assert led.victims(30, protect={"b"}) == ["c", "d"]
    assert led.victims(0) == []
    assert not led.fits(101) and led.fits(100)
    led.put("a", 5)  # overwrite adjusts usage
    assert led.used_bytes == 80
    assert LruLedger(None).victims(10**12) == []


# --- file backend ----------------------------------------------------------------------------


def test_file_roundtrip_binary_and_unsafe_keys(tmp_path: Path) -> None:
    be = FileStorageBackend(tmp_path / "l3")
    keys = ["00ff", "deadbeef.mamba", "../../escape", "a/b\\c", "ключ", "x" * 500, ".hidden"]
    values = [BINARY, b"", memoryview(b"view-bytes"), bytearray(b"\x00\r\n"), b"u", b"long" * 100, b"h"]
    assert be.set(keys, values) == [True] * len(keys)
    assert be.get(keys) == [bytes(v) for v in values]
    assert be.exists(keys + ["missing"]) == [True] * len(keys) + [False]
    assert be.get(["missing"]) == [None]
    # every file stays inside the root, and no temp files are left behind
    root = (tmp_path / "l3").resolve()
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(files) == len(keys)
    assert all(root in p.resolve().parents for p in files)
    assert list((root / ".tmp").iterdir()) == []
    assert all(len(key_filename(k)) < 200 for k in keys)
    assert be.delete(keys[:2] + ["missing"]) == 2
    assert be.exists(keys[:3]) == [False, False, True]
    assert be.drain_evicted() == []  # explicit deletes are not evictions
    assert backend_medium(be) is Medium.DISK
    assert backend_medium(FileStorageBackend(tmp_path / "shared", shared=True)) is Medium.EXTERNAL


def test_file_capacity_evicts_lru_and_reports(tmp_path: Path) -> None:
    be = FileStorageBackend(tmp_path, capacity_bytes=10_000)
    val = b"v" * 2000  # ~2.1 KB per file with header: 4 fit
    assert be.set(["a", "b", "c", "d"], [val] * 4) == [True] * 4
    assert be.get(["a"]) == [val]  # a becomes most recent; b is oldest
    assert be.set(["e"], [val]) == [True]
    assert be.drain_evicted() == ["b"]
    assert be.exists(["a", "b", "c", "d", "e"]) == [True, False, True, True, True]
    assert be.drain_evicted() == []  # already reported once
    cap = be.capacity()
    assert cap.limit_bytes == 10_000 and 0 < cap.used_bytes <= 10_000
    assert cap.used_bytes == sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))
    # a value that can never fit is refused, nothing evicted for it
    assert be.set(["huge"], [b"x" * 20_000]) == [False]
    assert be.drain_evicted() == []
    # a batch larger than capacity: plain LRU, its oldest member goes after all older keys;
    # usage never exceeds the limit
    assert be.set(["f", "g", "h", "i", "j"], [val] * 5) == [True] * 5
    assert be.drain_evicted() == ["c", "d", "a", "e", "f"]
    assert be.exists(["f", "g", "h", "i", "j"]) == [False, True, True, True, True]
    assert be.capacity().used_bytes <= 10_000


def test_file_corrupt_and_missing_files_give_none_and_are_reported(tmp_path: Path) -> None:
    be = FileStorageBackend(tmp_path)
    keys = ["k1", "k2", "k3", "k4"]
    assert be.set(keys, [BINARY] * 4) == [True] * 4
    paths = {p.name[:-3]: p for p in tmp_path.rglob("*.kv")}
    data = paths["k1"].read_bytes()
    paths["k1"].write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # bit rot in the value
    paths["k2"].write_bytes(data[: len(data) // 2])  # truncated write
    paths["k3"].unlink()  # removed behind the backend's back
    assert be.get(keys) == [None, None, None, BINARY]
    assert sorted(be.drain_evicted()) == ["k1", "k2", "k3"]
    assert be.corrupt_entries == 2
    assert be.exists(keys) == [False, False, False, True]
    paths["k4"].write_bytes(b"garbage")
    assert be.get(["k4"]) == [None]


def test_file_restart_recovers_entries_in_lru_order(tmp_path: Path) -> None:
    be = FileStorageBackend(tmp_path, capacity_bytes=10_000)
    val = b"z" * 2000
    be.set(["a", "b", "c"], [val] * 3)
    old = time.time() - 100
    for i, k in enumerate(["b", "a", "c"]):  # explicit recency: b oldest
        os.utime(next(tmp_path.rglob(f"{k}.kv")), (old + i, old + i))
    (tmp_path / "junk" ).mkdir()
    be2 = FileStorageBackend(tmp_path, capacity_bytes=10_000)
    assert be2.get(["a", "b", "c"]) == [val] * 3
    assert be2.capacity() == be.capacity()
    # the recovered LRU order follows the get() above (a, b, c); then new writes evict a first
    be2.set(["d", "e"], [val] * 2)
    assert be2.drain_evicted() == ["a"]


def test_file_write_failure_is_false_not_an_exception(tmp_path: Path) -> None:
    from producer.storage.file_backend import key_shard

    be = FileStorageBackend(tmp_path)
    assert be.set(["old"], [b"1"]) == [True]
    (tmp_path / key_shard("blocked")).write_bytes(b"")  # a file where the shard directory must go
    assert be.set(["blocked", "fine"], [b"x", b"y"]) == [False, key_shard("fine") != key_shard("blocked")]
    assert be.write_failures == 1
    assert be.exists(["blocked"]) == [False] and be.get(["old"]) == [b"1"]
    assert list((tmp_path / ".tmp").iterdir()) == []  # the failed temp file was cleaned up


def test_file_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    be = FileStorageBackend(tmp_path)
    with pytest.raises(ValueError, match="values"):
        be.set(["a", "b"], [b"x"])
    with pytest.raises(ValueError, match="bytes-like"):
        be.set(["a"], ["text"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="non-empty str"):
        be.get([""])
    with pytest.raises(ValueError, match="sequence of str"):
        be.exists("abc")  # type: ignore[arg-type]
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(ValueError, match="not usable"):
        FileStorageBackend(blocker)


@settings(max_examples=30, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=40), st.binary(max_size=64), max_size=12))
def test_file_backend_matches_a_dict(tmp_path_factory: pytest.TempPathFactory, entries: dict[str, bytes]) -> None:
    root = tmp_path_factory.mktemp("prop")
    be = FileStorageBackend(root)
    keys = list(entries)
    assert be.set(keys, [entries[k] for k in keys]) == [True] * len(keys)
    assert be.get(keys) == [entries[k] for k in keys]
    assert FileStorageBackend(root).get(keys) == [entries[k] for k in keys]  # survives a restart


def test_memory_backend_semantics() -> None:
    be = MemoryStorageBackend(capacity_bytes=10)
    assert be.set(["a", "b"], [b"12345", b"12345"]) == [True, True]
    assert be.get(["a"]) == [b"12345"]
    assert be.set(["c"], [b"123"]) == [True]
    assert be.drain_evicted() == ["b"]
    assert be.set(["big"], [b"x" * 11]) == [False]
    assert be.delete(["a", "zz"]) == 1
    assert be.capacity() == StorageCapacity(3, 10)
    assert isinstance(be, StorageBackend)


# --- storage worker --------------------------------------------------------------------------


class _Exploding(MemoryStorageBackend):
    """A backend with a bug: any batch containing the key 'boom' raises."""

    def set(self, keys, values):  # type: ignore[override]
        if "boom" in keys:
            raise RuntimeError("backend bug")
        return super().set(keys, values)

    def get(self, keys):  # type: ignore[override]
        if "boom" in keys:
            raise OSError("disk gone")
        return super().get(keys)


def _collect(worker: StorageWorker, n: int, timeout: float = 10.0) -> list:
    got: list = []
    deadline_poll(lambda: (got.extend(worker.poll()), len(got) >= n)[1], timeout)
    return got


def test_worker_runs_batches_and_survives_backend_exceptions() -> None:
    worker = StorageWorker(_Exploding(), max_inflight=8)
    assert worker.poll() == []  # non-blocking when nothing finished
    assert worker.submit_set(["a", "b"], [b"1", b"2"], tag="w1")
    assert worker.submit_set(["boom"], [b"x"], tag="w2")
    assert worker.submit_get(["a", "boom"], tag="r1")
    assert worker.submit_get(["a", "b", "zz"], tag="r2")
    assert worker.submit_exists(["a", "zz"], tag="e")
    assert worker.submit_delete(["a"], tag="d")
    res = {r.tag: r for r in _collect(worker, 6)}
    assert res["w1"].ok == [True, True] and res["w1"].error is None
    assert res["w2"].ok == [False] and "backend bug" in res["w2"].error
    assert res["r1"].ok == [False, False] and res["r1"].values == [None, None] and "disk gone" in res["r1"].error
    assert res["r2"].values == [b"1", b"2", None] and res["r2"].ok == [True, True, False]
    assert res["e"].ok == [True, False]
    assert res["d"].op == "delete"
    assert worker.errors == 2
    # still alive after the exceptions
    assert worker.submit_exists(["a", "b"], tag="after")
    (after,) = _collect(worker, 1)
    assert after.ok == [False, True]
    worker.close()
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit_exists(["a"])


class _Gated(MemoryStorageBackend):
    """Holds every set() until the test opens the gate — makes 'in flight' observable."""

    def __init__(self) -> None:
        super().__init__(capacity_bytes=4)
        self.gate = threading.Event()

    def set(self, keys, values):  # type: ignore[override]
        assert self.gate.wait(10)
        return super().set(keys, values)


def test_worker_backpressure_and_evictions_surface() -> None:
    be = _Gated()
    worker = StorageWorker(be, max_inflight=2)
    assert worker.submit_set(["a"], [b"aa"], tag=1)
    assert worker.submit_set(["b"], [b"bb"], tag=2)
    assert not worker.submit_set(["c"], [b"cc"], tag=3)  # full: refused, not blocked
    assert worker.rejected == 1 and worker.inflight == 2
    be.gate.set()
    assert worker.wait_idle(10)
    assert [r.tag for r in worker.poll()] == [1, 2]
    assert worker.submit_set(["c"], [b"cc"], tag=3)
    assert worker.wait_idle(10)
    assert worker.poll()[0].ok == [True]
    assert worker.drain_evicted() == ["a"]  # capacity 4 bytes: a dropped for c
    worker.close()


def test_worker_never_reports_an_eviction_before_its_store() -> None:
    """Scheduler pattern: drain evictions, then poll results. Every evicted key must already have
    its set result (batches here are larger than the store, so they evict their own keys)."""
    worker = StorageWorker(MemoryStorageBackend(capacity_bytes=40), max_inflight=1000)
    n_batches = 300
    for b in range(n_batches):
        keys = [f"{b}-{i}" for i in range(5)]
        assert worker.submit_set(keys, [b"0123456789"] * 5, tag=b)
    stored: set[str] = set()
    evicted_total = 0
    done = 0
    deadline = time.monotonic() + 20
    while done < n_batches:
        evicted = worker.drain_evicted()
        for r in worker.poll():
            stored.update(k for k, ok in zip(r.keys, r.ok) if ok)
            done += 1
        missing = [k for k in evicted if k not in stored]
        assert not missing, f"eviction of {missing[:3]} seen before their store result"
        evicted_total += len(evicted)
        assert time.monotonic() < deadline
    worker.close()
    evicted_total += len(worker.drain_evicted())
    assert len(stored) == 5 * n_batches and evicted_total == 5 * n_batches - 4  # 4 x 10 B fit in 40 B


def test_shared_file_root_seen_by_two_backends(tmp_path: Path) -> None:
    a = FileStorageBackend(tmp_path, shared=True)
    b = FileStorageBackend(tmp_path, shared=True)
    assert a.set(["k"], [b"from-a"]) == [True]
    assert b.exists(["k"]) == [True] and b.get(["k"]) == [b"from-a"]
    assert b.capacity().used_bytes > 0  # learned from the shared root
    assert a.delete(["k"]) == 1
    assert b.get(["k"]) == [None]
    assert b.drain_evicted() == ["k"]  # b had seen it; it is gone now


# --- config ----------------------------------------------------------------------------------


def test_config_inline_and_files(tmp_path: Path) -> None:
    assert load_backend_config(None) == {}
    assert load_backend_config("  ") == {}
    assert load_backend_config('{"url": "redis://h:1/0", "ttl_s": 30}') == {"url": "redis://h:1/0", "ttl_s": 30}
    want = {"root": "/tmp/x", "capacity_bytes": 1024, "shared": True}
    (tmp_path / "c.json").write_text(json.dumps(want))
    (tmp_path / "c.toml").write_text('root = "/tmp/x"\ncapacity_bytes = 1024\nshared = true\n')
    (tmp_path / "c.yaml").write_text("root: /tmp/x\ncapacity_bytes: 1024\nshared: true\n")
    (tmp_path / "c.yml").write_text("root: /tmp/x\ncapacity_bytes: 1024\nshared: true\n")
    for ext in ("json", "toml", "yaml", "yml"):
        assert load_backend_config(f"@{tmp_path}/c.{ext}") == want
    (tmp_path / "empty.yaml").write_text("")
    assert load_backend_config(f"@{tmp_path}/empty.yaml") == {}


@pytest.mark.parametrize(
    "content, name, match",
    [
        (None, "missing.json", "not found"),
        ("{}", "c.ini", "unsupported backend config file extension '.ini'"),
        ("{}", "noext", r"extension '\(none\)'"),
        ("{bad json", "c.json", "invalid JSON"),
        ("root = ", "c.toml", "invalid TOML"),
        ("a: [1, 2", "c.yaml", "invalid YAML"),
        ("[1, 2]", "c.json", "must be a mapping"),
        ("- a\n- b\n", "c.yaml", "must be a mapping"),
    ],
)
def test_config_file_errors_are_clear(tmp_path: Path, content: str | None, name: str, match: str) -> None:
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=match):
        load_backend_config(f"@{tmp_path}/{name}")


def test_config_inline_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        load_backend_config("{'single': 'quotes'}")
    with pytest.raises(ValueError, match="must be a mapping"):
        load_backend_config("[1]")
    with pytest.raises(ValueError, match="file path"):
        load_backend_config("@")


def test_config_yaml_without_pyyaml_says_how_to_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    (tmp_path / "c.yaml").write_text("a: 1\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # makes `import yaml` fail
    with pytest.raises(ValueError, match="pip install pyyaml"):
        load_backend_config(f"@{tmp_path}/c.yaml")


def test_make_storage_backend(tmp_path: Path) -> None:
    be = make_storage_backend("file", {"root": str(tmp_path), "capacity_bytes": 100})
    assert isinstance(be, FileStorageBackend) and be.capacity().limit_bytes == 100
    assert isinstance(make_storage_backend("Memory", {}), MemoryStorageBackend)
    r = make_storage_backend("redis", {"url": "redis://127.0.0.1:1/0", "ttl_s": 5})
    assert isinstance(r, RedisStorageBackend) and r.shared
    with pytest.raises(ValueError, match="unknown storage backend"):
        make_storage_backend("s3", {})
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['rot'\]"):
        make_storage_backend("file", {"rot": "/x"})
    with pytest.raises(ValueError, match=r"needs option\(s\) \['root'\]"):
        make_storage_backend("file", {})
    with pytest.raises(ValueError, match="ttl_s"):
        make_storage_backend("redis", {"ttl_s": -1})


# --- Redis backend (real server) -------------------------------------------------------------


def restart_redis_on(server: RedisServer, workdir: Path) -> subprocess.Popen[bytes]:
    """Start a fresh (empty) redis-server on the same port as `server` was using."""
    proc = spawn(
        [REDIS_BIN, "--port", str(server.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--protected-mode", "no", "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    server.proc = proc
    wait_until(server.ping, timeout=10)
    return proc


def kill_redis(server: RedisServer) -> None:
    server.proc.kill()
    server.proc.wait(timeout=10)


def test_redis_roundtrip_binary_batches(redis_server: RedisServer) -> None:
    be = RedisStorageBackend(redis_server.url, prefix="t:", batch_size=7)  # forces several pipelines
    keys = [page_key(i) for i in range(20)]
    values = [BINARY + bytes([i]) for i in range(20)]
    values[3] = memoryview(values[3])  # type: ignore[call-overload]
    assert be.set(keys, values) == [True] * 20
    assert be.get(keys + ["absent"]) == [bytes(v) for v in values] + [None]
    assert be.exists(["absent"] + keys[:2]) == [False, True, True]
    assert be.delete(keys[:5] + ["absent"]) == 5
    assert be.exists(keys[:6]) == [False] * 5 + [True]
    raw = redis.Redis.from_url(redis_server.url)
    assert raw.get("t:" + keys[10]) == values[10]  # really stored under the prefix, binary-exact
    cap = be.capacity()
    assert cap.used_bytes > 20 * len(BINARY) and cap.limit_bytes is None
    assert backend_medium(be) is Medium.EXTERNAL
    be.close()


def test_redis_ttl_expiry_is_reported_as_evicted(redis_server: RedisServer) -> None:
    be = RedisStorageBackend(redis_server.url, prefix="ttl:", ttl_s=0.05, notify_evictions=True)
    keeper = RedisStorageBackend(redis_server.url, prefix="ttl:")
    assert be.set(["short"], [b"x"]) == [True]
    assert keeper.set(["long"], [b"y"]) == [True]
    raw = redis.Redis.from_url(redis_server.url)
    assert 0 < raw.pttl("ttl:short") <= 50 and raw.pttl("ttl:long") == -1
    evicted: list[str] = []
    deadline_poll(lambda: (evicted.extend(be.drain_evicted()), "short" in evicted)[1], timeout=10)
    assert evicted == ["short"]
    assert be.get(["short", "long"]) == [None, b"y"]
    be.close()


def test_redis_down_gives_false_none_then_recovers(redis_server: RedisServer, tmp_path: Path) -> None:
    be = RedisStorageBackend(redis_server.url, prefix="r:", connect_timeout=0.5, socket_timeout=2)
    assert be.set(["a"], [b"1"]) == [True]
    kill_redis(redis_server)
    t0 = time.monotonic()
    assert be.set(["b", "c"], [b"2", b"3"]) == [False, False]
    assert be.get(["a", "b"]) == [None, None]
    assert be.exists(["a"]) == [False]
    assert be.delete(["a"]) == 0
    assert isinstance(be.capacity(), StorageCapacity)  # last known figures, no exception
    assert time.monotonic() - t0 < 10  # fails fast, not one timeout per key
    assert be.failures >= 4
    restart_redis_on(redis_server, tmp_path)
    assert be.set(["b"], [b"2"]) == [True]  # reconnected by itself
    assert be.get(["a", "b"]) == [None, b"2"]  # the restarted server is empty: a is honestly gone
    assert be.drain_evicted() == ["a"]  # ... and the loss is reported, so a Removed can follow
    assert be.data_losses == 1
    be.close()


def test_redis_killed_mid_batch_reports_no_false_store(redis_server: RedisServer, tmp_path: Path) -> None:
    """Writes are held server-side (CLIENT PAUSE WRITE) while the worker's pipeline is in flight;
    the server is then killed. Nothing of that batch may be reported stored; host data (the values
    the caller handed over) is untouched; the backend recovers after a restart."""
    be = RedisStorageBackend(redis_server.url, prefix="m:", connect_timeout=0.5, socket_timeout=10)
    worker = StorageWorker(be, max_inflight=4)
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("CLIENT", "PAUSE", "20000", "WRITE")
    keys = [page_key(i) for i in range(64)]
    host_pages = [bytearray(BINARY) for _ in keys]
    snapshot = [bytes(p) for p in host_pages]
    assert worker.submit_set(keys, host_pages, tag="backup")

    def batch_blocked_in_server() -> bool:
        return any(c.get("cmd") == "set" and "b" in c.get("flags", "") for c in admin.client_list())

    deadline_poll(batch_blocked_in_server)
    kill_redis(redis_server)
    assert worker.wait_idle(15)
    (res,) = worker.poll()
    assert res.tag == "backup" and res.ok == [False] * len(keys) and res.error is None
    assert [bytes(p) for p in host_pages] == snapshot
    assert worker.errors == 0
    restart_redis_on(redis_server, tmp_path)
    assert worker.submit_set(keys[:2], host_pages[:2], tag="retry")
    assert worker.wait_idle(10)
    (res2,) = worker.poll()
    assert res2.ok == [True, True]
    assert worker.submit_get(keys[:3], tag="read")
    assert worker.wait_idle(10)
    assert worker.poll()[0].values == [snapshot[0], snapshot[1], None]
    assert worker.drain_evicted() == []  # nothing was confirmed before the kill, so nothing "lost"
    worker.close()
    be.close()


def test_redis_flush_is_detected_as_data_loss(redis_server: RedisServer) -> None:
    tracked = RedisStorageBackend(redis_server.url, prefix="f:")
    untracked = RedisStorageBackend(redis_server.url, prefix="g:", track_keys=False)
    assert tracked.set(["k1", "k2", "k3"], [b"1", b"2", b"3"]) == [True] * 3
    assert tracked.delete(["k3"]) == 1  # deleted on request: not a loss
    assert untracked.set(["u"], [b"u"]) == [True]
    assert tracked.exists(["k1"]) == [True]
    assert tracked.drain_evicted() == []  # no false alarms while the data is there
    redis.Redis.from_url(redis_server.url).flushall()
    assert tracked.exists(["k1", "k2"]) == [False, False]
    assert tracked.drain_evicted() == ["k1", "k2"]
    assert untracked.get(["u"]) == [None] and untracked.drain_evicted() == []
    assert tracked.set(["k4"], [b"4"]) == [True]
    assert tracked.get(["k4"]) == [b"4"] and tracked.drain_evicted() == []  # marker rewritten
    redis.Redis.from_url(redis_server.url).flushall()
    assert tracked.set(["k4", "k5"], [b"4", b"5"]) == [True, True]
    assert tracked.drain_evicted() == []  # lost, but re-stored by the very call that noticed
    tracked.close()
    untracked.close()


def test_redis_unreachable_at_start_does_not_raise(free_port) -> None:
    be = RedisStorageBackend(f"redis://127.0.0.1:{free_port()}/0", connect_timeout=0.2, notify_evictions=True)
    assert be.set(["a"], [b"x"]) == [False]
    assert be.get(["a"]) == [None]
    assert be.drain_evicted() == []
    with pytest.raises(ValueError, match="bad Redis URL"):
        RedisStorageBackend("http://nope")
