# kvatlas — two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast system-deps bench clean

# torch is installed first, pinned to the CPU build that lies on local disk, so the
# project's `producer` extra never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[producer,dev]'
	touch $(STAMP)

system-deps:
	@bash scripts/ensure-system-deps.sh

demo: $(STAMP)
	$(VENV)/bin/kvatlas demo

test: $(STAMP) system-deps
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -x -m "not slow"

bench: $(STAMP)
	$(PY) bench/bench_wire.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
