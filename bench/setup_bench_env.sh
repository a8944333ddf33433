#!/usr/bin/env bash
# Creates .venv-bench: a bench-only environment holding Dynamo's in-process RadixTree
# (ai-dynamo-runtime==1.6.1) beside kvatlas, so bench/bench_index.py can measure both in one run,
# and SGLang 0.5.23 (--no-deps, with the CPU torch) so bench/bench_producer.py can run SGLang's own
# Python RadixCache beside the kvatlas producer cache.
# Idempotent: each part has its own stamp. Never touches the project's .venv.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${BENCH_VENV:-$ROOT/.venv-bench}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.bench-installed"
install_sglang() {
  # SGLang's radix cache only: --no-deps keeps its GPU stack out; the few pure-Python modules the
  # import chain touches are installed by name, heavy optional ones are stubbed by the bench itself.
  local stamp="$VENV/.sglang-installed"
  [[ -f "$stamp" ]] && return 0
  rm -f "$VENV/.sglang-install-failed"
  if "$VENV/bin/python" -m pip install -q torch==2.13.0 \
      && "$VENV/bin/python" -m pip install -q --no-deps 'sglang==0.5.23' \
      && "$VENV/bin/python" -m pip install -q psutil requests pydantic packaging xxhash ninja; then
    touch "$stamp"
    echo "sglang==0.5.23 installed (--no-deps)"
  else
    echo "pip install sglang==0.5.23 --no-deps failed (see output above)" > "$VENV/.sglang-install-failed"
    echo "WARNING: sglang could not be installed; bench_producer will print kvatlas numbers only" >&2
  fi
}
if [[ -f "$STAMP" ]]; then
  install_sglang
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
install_sglang
echo "bench env ready: $VENV"
