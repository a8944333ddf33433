"""Transfer engines: exact page copies, acked only after the bytes landed (real torch tensors)."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.transfer import (
    CudaTransferEngine,
    ManualTransferEngine,
    ThreadTransferEngine,
    TransferEngine,
    TransferEngineUnavailable,
    cuda_available,
    make_transfer_engine,
    page_bytes,
    page_runs,
    validate_copy,
)

PAGE = (2, 3, 4)  # (K/V, tokens, dim) — small but multi-dimensional pages


def pool(num_pages: int, seed: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if seed is None:
        return torch.zeros((num_pages, *PAGE), dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    return torch.randn((num_pages, *PAGE), generator=g).to(dtype)


def poll_until(engine: TransferEngine, n: int, timeout: float = 10.0) -> list[tuple[int, object]]:
    """Collect `n` acks by polling the engine (its own completion signal), with a deadline."""
    got: list[tuple[int, object]] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        got += engine.poll()
        assert time.monotonic() < deadline, f"only {len(got)}/{n} acks within {timeout}s"
    return got


# --- manual engine ---------------------------------------------------------------------------


def test_manual_unacked_copy_has_not_landed_and_completes_in_any_order() -> None:
    src, dst = pool(8, seed=1), pool(8)
    eng = ManualTransferEngine()
    a = eng.submit(src, [0, 1], dst, [5, 6], tag="a")
    b = eng.submit(src, [7], dst, [0], tag="b")
    assert eng.inflight == 2
    assert eng.poll() == []
    assert torch.count_nonzero(dst) == 0, "data landed before the copy was completed"

    eng.complete([b])
    assert eng.poll() == [(b, "b")]
    assert torch.equal(dst[0], src[7])
    assert torch.count_nonzero(dst[5:7]) == 0, "op a landed although only b was completed"

    eng.complete([a])
    assert eng.poll() == [(a, "a")]
    assert torch.equal(dst[5:7], src[0:2])
    assert eng.inflight == 0
    with pytest.raises(KeyError):
        eng.complete([a])  # already done


def test_manual_copy_reads_source_at_completion_time() -> None:
    # nothing is snapshotted at submit: the copy really happens when it is acked
    src, dst = pool(2, seed=2), pool(2)
    eng = ManualTransferEngine()
    op = eng.submit(src, [0], dst, [1], tag=None)
    src[0].fill_(3.5)
    eng.complete([op])
    assert torch.all(dst[1] == 3.5)


def test_manual_fail_is_reported_never_acked() -> None:
    src, dst = pool(4, seed=3), pool(4)
    eng = ManualTransferEngine()
    op = eng.submit(src, [0], dst, [0], tag="x")
    eng.fail([op], "link down")
    assert eng.poll() == []
    assert eng.poll_failed() == [(op, "x", "link down")]
    assert torch.count_nonzero(dst) == 0
    # wait_all lands everything still pending
    op2 = eng.submit(src, [1, 2], dst, [2, 3], tag="y")
    assert eng.wait_all() == [(op2, "y")]
    assert torch.equal(dst[2:4], src[1:3])


# --- thread engine ---------------------------------------------------------------------------


def test_thread_many_concurrent_copies_all_acked_bytes_equal() -> None:
    n_threads, per_thread = 4, 40
    src = pool(n_threads * per_thread, seed=4)
    dst = pool(n_threads * per_thread)
    eng = ThreadTransferEngine()
    submitted: dict[int, tuple[int, int]] = {}
    lock = threading.Lock()

    def producer(t: int) -> None:
        for i in range(per_thread):
            page = t * per_thread + i
            dst_page = src.shape[0] - 1 - page  # reversed placement: indices really matter
            op = eng.submit(src, [page], dst, [dst_page], tag=(t, i))
            with lock:
                submitted[op] = (page, dst_page)

    threads = [threading.Thread(target=producer, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    acks = poll_until(eng, n_threads * per_thread)
    assert sorted(op for op, _ in acks) == sorted(submitted)
    assert len({tag for _, tag in acks}) == n_threads * per_thread
    for op, _ in acks:
        s, d = submitted[op]
        assert torch.equal(dst[d], src[s])
    assert eng.inflight == 0
    assert eng.poll_failed() == []
    eng.close()


def test_thread_each_ack_implies_data_landed_multi_page_batches() -> None:
    src, dst = pool(64, seed=5), pool(64)
    eng = ThreadTransferEngine(latency_s=0.001)
    ops = {}
    for i in range(16):
        sp = [4 * i + j for j in range(4)]
        dp = [63 - p for p in sp]
        ops[eng.submit(src, sp, dst, dp, tag=i)] = (sp, dp)
    seen = 0
    deadline = time.monotonic() + 10
    while seen < 16:
        for op, _ in eng.poll():
            sp, dp = ops[op]
            # checked at the moment the ack is observed
            assert torch.equal(dst[dp], src[sp])
            seen += 1
        assert time.monotonic() < deadline
    eng.close()


def test_thread_link_model_delays_acks_by_latency_and_bandwidth() -> None:
    src, dst = pool(16, seed=6), pool(16)
    nbytes = page_bytes(src) * 4
    bw = nbytes / 0.04  # 40 ms of wire time per 4-page op
    eng = ThreadTransferEngine(latency_s=0.03, bandwidth_bytes_per_s=bw)
    t0 = time.monotonic()
    ops = [eng.submit(src, list(range(4 * i, 4 * i + 4)), dst, list(range(4 * i, 4 * i + 4)), tag=i) for i in range(4)]
    ack_time: dict[int, float] = {}
    deadline = t0 + 10
    while len(ack_time) < len(ops):
        now = time.monotonic()
        for op, _ in eng.poll():
            ack_time[op] = now
        assert now < deadline
    # serialised link: op k cannot be acked before (k+1) * wire + latency after the first submit
    for k, op in enumerate(ops):
        assert ack_time[op] - t0 >= (k + 1) * 0.04 + 0.03 - 1e-3
    assert [op for op, _ in sorted(ack_time.items(), key=lambda kv: kv[1])] == ops  # FIFO
    assert torch.equal(dst, src)
    eng.close()


def test_thread_wait_all_and_close_drain_queued_copies() -> None:
    src, dst = pool(32, seed=7), pool(32)
    eng = ThreadTransferEngine(latency_s=0.002)
    for i in range(32):
        eng.submit(src, [i], dst, [i], tag=i)
    done = eng.wait_all(timeout=10)
    assert sorted(tag for _, tag in done) == list(range(32))
    assert torch.equal(dst, src)
    dst2 = pool(32)
    for i in range(32):
        eng.submit(src, [i], dst2, [31 - i], tag=i)
    eng.close()  # must finish what was submitted, not drop it
    assert torch.equal(dst2, src.flip(0))
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(src, [0], dst2, [0])


def test_thread_wait_all_times_out_with_clear_error() -> None:
    src, dst = pool(2, seed=8), pool(2)
    eng = ThreadTransferEngine(latency_s=5.0)
    eng.submit(src, [0], dst, [0])
    with pytest.raises(TimeoutError, match="in flight"):
        eng.wait_all(timeout=0.05)
    eng.close(timeout=0.1)  # daemon thread; don't wait out the simulated link


def test_thread_failed_copy_is_reported_and_engine_keeps_working() -> None:
    src = pool(4, seed=9)
    bad_dst = torch.zeros((4, *PAGE), requires_grad=True)  # in-place write on a grad leaf fails
    good_dst = pool(4)
    eng = ThreadTransferEngine()
    bad = eng.submit(src, [0], bad_dst, [0], tag="bad")
    good = eng.submit(src, [1], good_dst, [2], tag="good")
    assert eng.wait_all(timeout=10) == [(good, "good")]
    failed = eng.poll_failed()
    assert [(op, tag) for op, tag, _ in failed] == [(bad, "bad")]
    assert torch.equal(good_dst[2], src[1])
    eng.close()


# --- validation and helpers ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(sp=[0, 1], dp=[0]), "has 2 pages"),
        (dict(sp=[8], dp=[0]), "src page 8 out of range"),
        (dict(sp=[0], dp=[-1]), "dst page -1 out of range"),
        (dict(sp=[0, 1], dp=[3, 3]), "duplicates"),
        (dict(sp=[0.5], dp=[0]), "must contain ints"),
        (dict(dst=torch.zeros((8, 2, 3, 5))), "page shape mismatch"),
        (dict(dst=torch.zeros((8, *PAGE), dtype=torch.float16)), "dtype mismatch"),
    ],
)
def test_bad_copies_are_rejected_at_submit(kw: dict, match: str) -> None:
    src = pool(8, seed=10)
    dst = kw.get("dst", pool(8))
    for eng in (ManualTransferEngine(), ThreadTransferEngine()):
        with pytest.raises(ValueError, match=match):
            eng.submit(src, kw.get("sp", [0]), dst, kw.get("dp", [0]), tag=None)
        assert eng.inflight == 0
        eng.close()


def test_same_pool_overlap_rejected_but_disjoint_allowed() -> None:
    p = pool(8, seed=11)
    with pytest.raises(ValueError, match="overlap"):
        validate_copy(p, [0, 1], p, [1, 2])
    eng = ManualTransferEngine()
    eng.submit(p, [0, 1], p, [4, 5], tag=None)
    eng.wait_all()
    assert torch.equal(p[4:6], p[0:2])


def test_page_index_types_numpy_and_tensor() -> None:
    import numpy as np

    src, dst = pool(6, seed=12), pool(6)
    eng = ManualTransferEngine()
    eng.submit(src, np.array([1, 2]), dst, torch.tensor([4, 5]), tag=None)
    eng.wait_all()
    assert torch.equal(dst[4:6], src[1:3])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=30))
def test_page_runs_partition_the_list(pages: list[int]) -> None:
    rebuilt: list[int] = []
    for pos, first, n in page_runs(pages):
        assert pos == len(rebuilt) and n >= 1
        rebuilt += list(range(first, first + n))
    assert rebuilt == pages


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_thread_engine_matches_reference_copy(data: st.DataObject) -> None:
    n = 12
    src = pool(n, seed=data.draw(st.integers(0, 1000)))
    dst = pool(n)
    expected = dst.clone()
    eng = ThreadTransferEngine()
    for _ in range(data.draw(st.integers(1, 5))):
        dp = data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
        sp = data.draw(st.lists(st.integers(0, n - 1), min_size=len(dp), max_size=len(dp)))
        eng.submit(src, sp, dst, dp, tag=None)
        for s, d in zip(sp, dp):  # FIFO: later ops overwrite earlier ones
            expected[d] = src[s]
    eng.wait_all(timeout=10)
    eng.close()
    assert torch.equal(dst, expected)


# --- CUDA engine and factory -----------------------------------------------------------------


@pytest.mark.skipif(cuda_available(), reason="checks the refusal path on a machine without a GPU")
def test_cuda_engine_refuses_cleanly_without_gpu() -> None:
    with pytest.raises(TransferEngineUnavailable, match="CUDA device"):
        CudaTransferEngine()
    with pytest.raises(TransferEngineUnavailable):
        make_transfer_engine("cuda")
    eng = make_transfer_engine("auto", latency_s=0.0, device="cuda:0")
    assert isinstance(eng, ThreadTransferEngine)
    eng.close()


def test_factory_kinds_and_errors() -> None:
    assert isinstance(make_transfer_engine("manual"), ManualTransferEngine)
    eng = make_transfer_engine("thread", latency_s=0.001)
    assert isinstance(eng, ThreadTransferEngine) and isinstance(eng, TransferEngine)
    eng.close()
    with pytest.raises(ValueError, match="unknown transfer engine"):
        make_transfer_engine("dma")
    with pytest.raises(ValueError, match="no options"):
        make_transfer_engine("manual", latency_s=1)
    with pytest.raises(ValueError, match="bandwidth"):
        ThreadTransferEngine(bandwidth_bytes_per_s=0)


# --- shared bookkeeping: one suite every engine passes ------------------------------------------

needs_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device (scripts/gpu_check.sh)")
ENGINE_KINDS = ["manual", "thread", pytest.param("cuda", marks=needs_gpu)]


def engine_and_pools(kind: str, pages: int, seed: int) -> tuple[TransferEngine, torch.Tensor, torch.Tensor]:
    """An engine and a (source, destination) pool pair it can copy between (device → host for CUDA)."""
    src, dst = pool(pages, seed=seed), pool(pages)
    if kind == "cuda":
        return make_transfer_engine("cuda"), src.cuda(), dst.pin_memory()
    return make_transfer_engine(kind), src, dst


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_engine_acks_each_op_once_with_its_tag_and_refuses_after_close(kind: str) -> None:
    eng, src, dst = engine_and_pools(kind, 8, seed=13)
    with eng:
        ids = [eng.submit(src, [i], dst, [7 - i], tag=("t", i)) for i in range(4)]
        empty = eng.submit(src, [], dst, [], tag="empty")  # a copy of no pages is acked like any other
        assert len(set(ids + [empty])) == 5, "op ids must be unique"
        done = eng.wait_all(timeout=30)
        assert sorted(done, key=lambda d: d[0]) == sorted([(i, ("t", k)) for k, i in enumerate(ids)] + [(empty, "empty")])
        assert eng.poll() == [] and eng.poll_failed() == [], "an ack or failure is handed over once"
        assert eng.inflight == 0
        for i in range(4):
            assert torch.equal(dst[7 - i].cpu(), src[i].cpu())
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(src, [0], dst, [0])
    assert eng.inflight == 0


@pytest.mark.parametrize("kind", ["manual", "thread"])
def test_engine_failure_is_reported_once_and_never_acked(kind: str) -> None:
    eng, src, _ = engine_and_pools(kind, 4, seed=14)
    bad_dst = torch.zeros((4, *PAGE), requires_grad=True)  # in-place write on a grad leaf fails at copy time
    good_dst = pool(4)
    bad = eng.submit(src, [0], bad_dst, [0], tag="bad")
    good = eng.submit(src, [1], good_dst, [3], tag="good")
    assert eng.wait_all(timeout=30) == [(good, "good")]
    failed = eng.poll_failed()
    assert [(op, tag) for op, tag, _ in failed] == [(bad, "bad")]
    assert failed[0][2].startswith("RuntimeError")  # the reason is the copy's own error
    assert eng.poll_failed() == [] and eng.poll() == []
    assert eng.inflight == 0
    eng.close()


@needs_gpu
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_cuda_engine_copies_pages_in_every_direction(direction: str) -> None:
    src, dst = pool(16, seed=15), pool(16)
    src = src.pin_memory() if direction == "h2d" else src.cuda()
    dst = dst.pin_memory() if direction == "d2h" else dst.cuda()
    eng = CudaTransferEngine()
    sp, dp = [0, 1, 2, 5, 9, 10], [15, 3, 4, 5, 0, 1]  # runs and gaps on both sides
    op = eng.submit(src, sp, dst, dp, tag=direction)
    assert eng.wait_all(timeout=60) == [(op, direction)]
    assert torch.equal(dst[dp].cpu(), src[sp].cpu())
    with pytest.raises(ValueError, match="at least one CUDA pool"):
        eng.submit(pool(2, seed=1), [0], pool(2), [1])
    eng.close()
