"""The ingest loop's memory trimming policy (router_api.memtrim) and the real glibc call."""
from __future__ import annotations

import platform

import pytest

from router_api.memtrim import MemoryTrimmer


def test_trims_only_after_enough_batches_and_at_most_once_per_interval() -> None:
    calls: list[int] = []
    t = MemoryTrimmer(min_batches=100, min_interval_s=2.0, trim=lambda pad: calls.append(pad) or 1)
    assert not t.maybe_trim(0.0)  # nothing applied yet
    t.note(99)
    assert not t.maybe_trim(0.0)
    t.note(1)
    assert t.maybe_trim(10.0) and calls == [0]
    t.note(500)
    assert not t.maybe_trim(11.0)  # too soon after the last trim
    assert t.maybe_trim(12.0) and t.trims == 2
    assert not t.maybe_trim(20.0)  # the count restarted at the trim


def test_a_failing_trim_disables_itself_and_never_raises() -> None:
    def broken(pad: int) -> int:
        raise OSError("no malloc_trim here")

    t = MemoryTrimmer(min_batches=1, min_interval_s=0.0, trim=broken)
    t.note(5)
    assert t.maybe_trim(1.0) is False and not t.available
    t.note(5)
    assert t.maybe_trim(2.0) is False


def test_disabled_trimmer_does_nothing() -> None:
    t = MemoryTrimmer(min_batches=1, trim=False)
    t.note(10)
    assert not t.available and not t.maybe_trim(100.0)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_real_malloc_trim_returns_freed_memory() -> None:
    def rss_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    t = MemoryTrimmer(min_batches=1, min_interval_s=0.0)
    assert t.available
    # Many mid-sized buffers (below the mmap threshold, so they live on the heap), then free
    # all but the last: glibc keeps the freed heap mapped until trimmed.
    bufs = [bytearray(64 * 1024) for _ in range(800)]
    for b in bufs:
        b[::4096] = b"\x01" * len(b[::4096])  # touch every page
    keep = bufs[-1]
    del bufs
    before = rss_kib()
    t.note(1)
    assert t.maybe_trim(1.0)
    assert rss_kib() < before - 20_000  # most of the ~50 MiB freed went back
    assert keep[0] == 1
