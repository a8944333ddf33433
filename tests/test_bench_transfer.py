"""`bench/bench_transfer.py`: without a GPU it says so and exits 0 (nothing measured); its `--cpu-check`
runs the same TieredCache plumbing (write-through, eviction, load-back) on CPU pools with the thread
engine and checks that the bytes loaded back are the bytes written."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

from bench import bench_transfer

from producer.transfer import cuda_available  # noqa: E402


@pytest.mark.skipif(cuda_available(), reason="this machine has a GPU: the bench measures instead")
def test_without_a_gpu_it_says_so_and_exits_0() -> None:
    r = subprocess.run([sys.executable, "-m", "bench.bench_transfer"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "no CUDA device" in r.stdout and "nothing measured" in r.stdout
    assert "GB/s" not in r.stdout


def test_cpu_check_round_trips_the_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    if cuda_available():
        pytest.skip("with a GPU --cpu-check still measures the CUDA path")
    assert bench_transfer.main(["--cpu-check", "--requests", "3", "--pages", "4", "--layers", "1",
                                "--kv-heads", "2", "--head-dim", "8", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert "plumbing only" in out
    assert "offload (device → host)" in out and "load-back (host → device)" in out
    assert "bytes loaded back equal the bytes written: True" in out
