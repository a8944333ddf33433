"""The Mooncake Store L3 backend against a real `mooncake_master` started by each test (no mock):
the StorageBackend rules, zero-copy reads, the producer-owned share, the existence audit, and the
failures — master down at start, killed mid-batch, a put refused for space, a read of a key the
store dropped."""
from __future__ import annotations

import pytest

from producer.storage import StorageBackend, StorageWorker, backend_medium, load_backend_config, make_storage_backend
from producer.storage.mooncake_backend import MooncakeStorageBackend, parse_size
from schemas.media import Medium
from support.net import wait_until
from support.mooncake import MooncakeMaster, mooncake_master, restart, start_mooncake_master  # noqa: F401

PAGE = bytes(range(256)) * 64  # 16 KiB, every byte value


def backend(master: MooncakeMaster, **kw: object) -> MooncakeStorageBackend:
    be = make_storage_backend("mooncake", master.backend_config(**kw))
    assert isinstance(be, MooncakeStorageBackend)
    return be


def test_roundtrip_shared_medium_and_zero_copy_read(mooncake_master: MooncakeMaster) -> None:
    be = backend(mooncake_master)
    try:
        assert isinstance(be, StorageBackend) and backend_medium(be) is Medium.EXTERNAL
        keys = [f"{i:016x}" for i in range(40)] + ["unicode-ключ", "x" * 300]
        values = [bytes([i]) * 1000 + PAGE for i in range(40)] + [memoryview(b"view"), bytearray(b"\x00\r\n")]
        assert be.set(keys, values) == [True] * len(keys)
        assert be.get(keys + ["absent"]) == [bytes(v) for v in values] + [None]
        assert be.exists(["absent", keys[3]]) == [False, True]
        bufs = [memoryview(bytearray(len(v) + 7)) for v in values[:3]] + [memoryview(bytearray(2))]
        got = be.get_into(keys[:3] + [keys[5]], bufs)
        assert got[:3] == [len(v) for v in values[:3]] and got[3] == -1  # too small: refused, not cut
        assert [bytes(b[:n]) for b, n in zip(bufs, got[:3])] == [bytes(v) for v in values[:3]]
        assert be.capacity().used_bytes == sum(len(bytes(v)) for v in values)
        assert be.knows(keys) is None  # a shared store: its contents are not known locally
    finally:
        be.close()


def test_another_client_reads_what_one_wrote_and_deletes_are_seen(mooncake_master: MooncakeMaster) -> None:
    a, b = backend(mooncake_master), backend(mooncake_master)
    try:
        assert a.set(["k1", "k2"], [PAGE, PAGE[:100]]) == [True, True]
        assert b.get(["k1", "k2"]) == [PAGE, PAGE[:100]]
        # a read (or an existence check) leases the key for 100 ms: the removal waits for the
        # lease and goes through on a later drain
        a.delete(["k1"])
        wait_until(lambda: (a.drain_evicted(), a.pending_removals == 0)[1], timeout=10.0)
        assert b.exists(["k1"]) == [False]
        assert b.get(["k1"]) == [None]
    finally:
        a.close()
        b.close()


def test_empty_values_are_refused_not_claimed(mooncake_master: MooncakeMaster) -> None:
    be = backend(mooncake_master)
    try:
        assert be.set(["e", "f"], [b"", b"x"]) == [False, True]  # Mooncake holds no zero-size objects
        assert be.capacity().used_bytes == 1
    finally:
        be.close()


def test_share_is_owned_by_the_producer_every_removal_is_reported(mooncake_master: MooncakeMaster) -> None:
    be = backend(mooncake_master, capacity_bytes=4 * len(PAGE))
    try:
        keys = [f"p{i}" for i in range(6)]
        for k in keys:
            assert be.set([k], [PAGE]) == [True]
        gone = be.drain_evicted()
        assert gone == keys[:2]  # the oldest, before the share was exceeded
        assert be.capacity().used_bytes == 4 * len(PAGE)
        assert be.exists(keys) == [False, False, True, True, True, True]
    finally:
        be.close()


def test_a_refused_rewrite_keeps_its_claim_inside_the_share(mooncake_master: MooncakeMaster) -> None:
    """A batch that rewrites a claimed key at its tail: the key's old bytes stay claimed when the
    share refuses the rewrite, so the keys before it cannot take that room."""
    kib2 = bytes(2048)
    be = backend(mooncake_master, capacity_bytes=5 * 1024)
    try:
        assert be.set(["r3"], [kib2]) == [True]
        assert be.set(["r9", "r8", "r3"], [kib2] * 3) == [True, False, False]  # r8 does not fit: the head
        assert be.capacity().used_bytes == 4096 and be.drain_evicted() == []
        assert be.set(["r7"], [bytes(3072)]) == [True]  # room made from the LRU claim, reported once
        assert be.drain_evicted() == ["r3"] and be.capacity().used_bytes == 5 * 1024
        be.delete(["r9", "r7"])
        assert be.capacity().used_bytes == 0 and be.drain_evicted() == []
    finally:
        be.close()


def test_a_rewrite_cancels_a_removal_deferred_for_a_lease(tmp_path_factory: pytest.TempPathFactory) -> None:
    """delete() of a leased key defers the removal; a confirmed write of the key before the retry
    claims it again (Mooncake keeps the object), so the retry must not remove it under the claim."""
    master = start_mooncake_master(tmp_path_factory.mktemp("mc"), "--default_kv_lease_ttl=30000")
    be = backend(master)
    try:
        assert be.set(["w"], [PAGE]) == [True] and be.get(["w"]) == [PAGE]  # leased for 30 s
        be.delete(["w"])
        assert be.pending_removals == 1 and be.capacity().used_bytes == 0
        assert be.set(["w"], [PAGE]) == [True]
        assert be.pending_removals == 0  # the claim holds the bytes: nothing left to remove
        assert be.drain_evicted() == [] and be.exists(["w"]) == [True] and be.audit_now() == []
        assert be.capacity().used_bytes == len(PAGE)
    finally:
        be.close()
        master.stop()


def test_the_audit_reports_keys_the_store_dropped_behind_its_back(mooncake_master: MooncakeMaster) -> None:
    be = backend(mooncake_master, audit_batch=4, audit_interval_s=0.001)
    other = backend(mooncake_master)
    try:
        keys = [f"a{i}" for i in range(10)]
        assert be.set(keys, [PAGE] * 10) == [True] * 10
        assert be.drain_evicted() == []
        other.delete(keys[2:5])  # as a master eviction would: nobody tells `be`
        # a fresh put is leased (100 ms here): the removal goes through on a later drain
        wait_until(lambda: (other.drain_evicted(), other.pending_removals == 0)[1], timeout=10.0)
        found: list[str] = []
        for _ in range(3):  # ceil(10 / 4) audits cover every claimed key
            be._next_audit = 0.0
            found += be.drain_evicted()
        assert sorted(found) == keys[2:5]
        assert be.audit_losses == 3 and be.capacity().used_bytes == 7 * len(PAGE)
    finally:
        be.close()
        other.close()


def test_a_read_of_a_dropped_key_reports_it_at_once(mooncake_master: MooncakeMaster) -> None:
    be = backend(mooncake_master, audit_interval_s=3600)
    other = backend(mooncake_master)
    try:
        assert be.set(["g1", "g2"], [PAGE, PAGE]) == [True, True]
        be.drain_evicted()  # the first audit runs at once; the next one is an hour away
        other.delete(["g1"])
        wait_until(lambda: (other.drain_evicted(), other.pending_removals == 0)[1], timeout=10.0)
        assert be.get_into(["g1", "g2"], [memoryview(bytearray(len(PAGE)))] * 2) == [-1, len(PAGE)]
        assert be.drain_evicted() == ["g1"] and be.read_losses == 1
    finally:
        be.close()
        other.close()


def test_a_put_refused_for_space_is_not_claimed(tmp_path_factory: pytest.TempPathFactory) -> None:
    master = start_mooncake_master(tmp_path_factory.mktemp("mc"), "--eviction_high_watermark_ratio=1.0")
    be = backend(master, global_segment_size=16 << 20)  # the whole pool: 16 MiB
    try:
        big = bytes(1 << 20)
        out = be.set([f"b{i}" for i in range(24)], [big] * 24)
        assert 0 < sum(out) < 24 and be.refused_no_space > 0
        held = be.exists([f"b{i}" for i in range(24)])
        assert all(h for h, ok in zip(held, out) if ok)  # every confirmed key is really there
        assert be.capacity().used_bytes == sum(out) * len(big)
    finally:
        be.close()
        master.stop()


def test_master_down_at_start_then_up(tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp("mc")
    master = start_mooncake_master(tmp)
    master.kill()
    be = backend(master, reconnect_interval_s=0.05)
    worker = StorageWorker(be)
    try:
        assert worker.submit_set(["d"], [PAGE], "t")
        assert worker.wait_idle(10.0)
        [r] = worker.poll()
        assert r.ok == [False] and be.failures >= 1  # no claim, no raise, answered at once (probe)
        master = restart(master, tmp)
        be._next_connect = 0.0
        assert worker.submit_set(["d"], [PAGE], "t2") and worker.wait_idle(60.0)
        assert worker.poll()[0].ok == [True] and be.connects == 1
    finally:
        worker.close()
        be.close()
        master.stop()


@pytest.mark.slow  # the client takes ~10 s to find the restarted master
def test_master_killed_mid_batch_claims_nothing_and_the_restart_is_audited(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp("mc")
    master = start_mooncake_master(tmp)
    be = backend(master)
    try:
        assert be.set(["m1", "m2"], [PAGE, PAGE]) == [True, True]
        master.kill()
        assert be.set(["m3"], [PAGE]) == [False]
        assert be.get(["m1"]) == [None] and be.exists(["m1"]) == [False]
        assert be.drain_evicted() == []  # unreachable is not lost: nothing is reported yet
        master = restart(master, tmp)  # a fresh master holds nothing
        lost = wait_until(lambda: be.audit_now(), timeout=30.0)
        assert sorted(lost) == ["m1", "m2"]
    finally:
        be.close()
        master.stop()


def test_config_files_and_sizes(tmp_path) -> None:
    f = tmp_path / "mc.toml"
    f.write_text('master_server_address = "10.0.0.1:50051"\nmetadata_server = "http://10.0.0.1:8080/metadata"\n'
                 'protocol = "tcp"\nglobal_segment_size = "4gb"\nlocal_buffer_size = "512mb"\n')
    cfg = load_backend_config(f"@{f}")
    assert cfg["global_segment_size"] == "4gb"
    be = make_storage_backend("mooncake", cfg)
    assert be.name == "mooncake:10.0.0.1:50051"
    assert parse_size("512MB", "x") == 512 << 20 and parse_size(7, "x") == 7
    for bad in ({"protocol": "udp"}, {"global_segment_size": "lots"}, {"metadata_server": "http://h/metadata"},
                {"nope": 1}):
        with pytest.raises(ValueError):
            make_storage_backend("mooncake", bad)


def test_claims_never_lead_the_store_property(mooncake_master: MooncakeMaster) -> None:
    """Random writes (some past the share, some empty), removals by another client behind the
    backend's back, reads, drains: a key is claimed only after a confirmed write, every key the
    backend stops holding is reported exactly once, and after a full audit every claim is held."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    ops = st.lists(st.one_of(
        st.tuples(st.just("set"), st.lists(st.integers(0, 11), min_size=1, max_size=4), st.integers(0, 3)),
        st.tuples(st.just("drop"), st.lists(st.integers(0, 11), min_size=1, max_size=3), st.just(0)),
        st.tuples(st.just("get"), st.lists(st.integers(0, 11), min_size=1, max_size=4), st.just(0)),
        st.tuples(st.just("drain"), st.just([0]), st.just(0)),
    ), max_size=25)
    be = backend(mooncake_master, capacity_bytes=5 * 1024, audit_interval_s=1e-6, audit_batch=3)
    other = backend(mooncake_master)  # clients are costly to set up: one pair, a key namespace per example
    run = [0]

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
    @given(ops)
    def check(seq: list[tuple[str, list[int], int]]) -> None:
        run[0] += 1
        try:
            steps(seq)
        except BaseException:  # leave nothing claimed for the next example: it must fail on its own
            be.delete([f"e{run[0]}:k{i}" for i in range(12)])
            be.drain_evicted()
            raise

    def steps(seq: list[tuple[str, list[int], int]]) -> None:
        claimed: set[str] = set()
        for op, ids, size in seq:
            keys = [f"e{run[0]}:k{i}" for i in dict.fromkeys(ids)]
            if op == "set":
                ok = be.set(keys, [bytes([size]) * (size * 1024) for _ in keys])  # size 0: refused
                assert sum(ok) * size <= 5 and all(not o for o in ok[sum(ok):])  # the head that fits
                claimed.update(k for k, o in zip(keys, ok) if o)
            elif op == "drop":
                other.delete(keys)
                wait_until(lambda: (other.drain_evicted(), other.pending_removals == 0)[1], timeout=10.0)
            elif op == "get":
                for k, v in zip(keys, be.get(keys)):
                    assert v is None or len(set(v)) == 1  # whole values only
            gone = be.drain_evicted()
            assert len(gone) == len(set(gone)) and set(gone) <= claimed  # once each, only claims
            claimed -= set(gone)
            assert be.capacity().used_bytes <= 5 * 1024
        claimed -= set(be.audit_now())
        claimed -= set(be.drain_evicted())
        if claimed:
            assert all(be.exists(sorted(claimed)))  # after a full audit no claim leads the store
        be.delete(sorted(claimed))  # the next example starts with nothing claimed
        assert be.capacity().used_bytes == 0 and be.drain_evicted() == []

    try:
        check()
    finally:
        be.close()
        other.close()
