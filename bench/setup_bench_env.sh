#!/usr/bin/env bash
# Creates /work/main/.venv-bench: a bench-only environment holding Dynamo's in-process RadixTree
# (ai-dynamo-runtime==1.6.1) beside kvatlas, so bench/bench_index.py can measure both in one run.
# Idempotent: a second run only checks the stamp. Never touches the project's .venv.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${BENCH_VENV:-$ROOT/.venv-bench}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.bench-installed"
if [[ -f "$STAMP" ]]; then
  echo "bench env ready: $VENV"
  exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q msgspec numpy pyzmq
"$VENV/bin/python" -m pip install -q -e "$ROOT" --no-deps
if "$VENV/bin/python" -m pip install -q 'ai-dynamo-runtime==1.6.1'; then
  "$VENV/bin/python" -c 'import dynamo' && echo "ai-dynamo-runtime==1.6.1 installed"
else
  # Recorded so the bench can say exactly why Dynamo's numbers are missing.
  echo "pip install ai-dynamo-runtime==1.6.1 failed (see output above)" > "$VENV/.dynamo-install-failed"
  echo "WARNING: ai-dynamo-runtime could not be installed; the bench will print kvatlas numbers only" >&2
fi
touch "$STAMP"
echo "bench env ready: $VENV"
