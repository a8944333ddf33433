#!/usr/bin/env bash
# The producer's checks that need a GPU, in one run: the transfer engines' tests with the CUDA engine
# (tests/test_producer_transfer.py runs its CUDA cases only where torch sees a device) and
# bench/bench_transfer.py (offload / load-back through TieredCache + CudaTransferEngine vs plain torch
# copies; it exits non-zero when the bytes loaded back differ). Exits non-zero on any failure, and when
# no CUDA device is visible (so a CPU-only run can never pass for a GPU check).
#
#   bash scripts/gpu_check.sh                      # uses .venv/bin/python
#   PYTHON=/path/to/python bash scripts/gpu_check.sh   # a Python whose torch is a CUDA build
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"

"$PY" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA device visible to torch {torch.__version__} (a CPU build?)")
print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
PY

echo "== producer transfer tests (CUDA cases included)"
"$PY" -m pytest -q -p no:cacheprovider -rs tests/test_producer_transfer.py tests/test_bench_transfer.py

echo "== bench/bench_transfer.py"
"$PY" bench/bench_transfer.py --requests "${REQUESTS:-16}" --pages "${PAGES:-32}" --reps "${REPS:-3}"
echo "gpu_check: passed"
