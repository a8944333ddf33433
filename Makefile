# kvatlas — two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast typecheck system-deps bench clean

# Build headers first (libssl-dev for the producer's C helper: scripts/ensure-system-deps.sh --build),
# since the editable install compiles the C accelerators and leaves out one that cannot build (its
# package then runs its pure path). torch is installed next, pinned to the CPU build that lies on
# local disk, so the project's `producer` extra never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@bash scripts/ensure-system-deps.sh --build
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[producer,dev,mooncake]'
	touch $(STAMP)

# A checkout whose C sources changed since the last build (a pull, a branch switch) is rebuilt in
# place before anything runs; the loaders refuse such a stale build anyway (cbuild/tables.py).
NATIVE_SRC := $(wildcard indexer/_native/*.c indexer/_native/*.h producer/_native/*.c producer/_native/*.h \
                producer/_native/third_party/*.h) setup.py cbuild/tables.py
NATIVE := $(VENV)/.native
$(NATIVE): $(STAMP) $(NATIVE_SRC)
	$(PY) setup.py -q build_ext --inplace
	touch $(NATIVE)

system-deps:
	@bash scripts/ensure-system-deps.sh

demo: $(NATIVE)
	$(VENV)/bin/kvatlas demo

test: $(NATIVE) system-deps
	$(PY) -m pytest -q

# mypy over every shipped package ([tool.mypy] in pyproject.toml); a package that is not there yet
# (router/ before the router moved) is skipped by the wildcard.
TYPED_PACKAGES := $(wildcard schemas cbuild transport indexer router_api router producer sim cli)
typecheck: $(STAMP)
	$(PY) -m mypy $(TYPED_PACKAGES)

test-fast: $(NATIVE)
	$(PY) -m pytest -q -x -m "not slow"

bench: $(NATIVE)
	$(PY) -m bench.bench_wire

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# ASan + UBSan build of the C accelerator, in its own directory (the in-tree build is untouched),
# running the fuzz and differential tests in their short mode, and the HTTP body parsers (docs/index-core.md);
# the subscriber's receive loop and the producer's page-hash / event batch module likewise.
# kvnative.c #includes its parts (hashing.c, u64map.c, ...): one translation unit, as in setup.py.
SAN_SO    := build/sanitize/_kvnative.so
SAN_TESTS := tests/test_fuzz_native.py tests/test_index_fastpath.py tests/test_index_native.py \
             tests/test_index_conformance.py tests/test_native_built.py tests/test_service_bodies.py \
             tests/test_index_apply_run.py tests/test_zmqdrain.py tests/test_producer_batch.py tests/test_page_hash.py \
             tests/test_score_answer.py tests/test_score_answer_pending.py tests/test_score_bodies.py tests/test_bench_apply.py \
             tests/test_sharded_index.py tests/test_event_tables_drift.py tests/test_hybrid_index_streams.py \
             tests/test_group_isolation.py tests/test_hybrid_c_apply.py tests/test_score_offload.py \
             tests/test_restore_native.py tests/test_wide_fleet.py tests/test_group_walk_native.py \
             tests/test_hybrid_answer.py tests/test_kv_blocks_property.py tests/test_group_memory.py \
             tests/test_holder_lists.py tests/test_churn_at_width.py tests/test_service_stream.py
SAN_ZMQ_SO := build/sanitize/_zmqdrain.so
SAN_PH_SO  := build/sanitize/_pagehash.so
SAN_PH_SRC := $(addprefix producer/_native/,module.c chains.c pages.c msgpack.c batch.c)  # as setup.py

.PHONY: test-sanitize
test-sanitize: $(NATIVE)
	@mkdir -p $(dir $(SAN_SO))
	gcc -shared -fPIC -std=c11 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
	    -fno-sanitize-recover=all -I"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
	    -DSOURCE_DIGEST=\"$$($(PY) -c 'from cbuild.tables import KVNATIVE_FILES as F, source_digest; print(source_digest(F))')\" \
	    indexer/_native/kvnative.c -o $(SAN_SO)
	gcc -shared -fPIC -std=c11 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
	    -fno-sanitize-recover=all -I"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
	    indexer/_native/zmqdrain.c -o $(SAN_ZMQ_SO) -ldl
	gcc -shared -fPIC -std=c11 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
	    -fno-sanitize-recover=all -I"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
	    -DSOURCE_DIGEST=\"$$($(PY) -c 'from cbuild.tables import PAGEHASH_FILES as F, source_digest; print(source_digest(F))')\" \
	    $(SAN_PH_SRC) -o $(SAN_PH_SO) -lcrypto
	PYTHONMALLOC=malloc ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	    LD_PRELOAD="$$(gcc -print-file-name=libasan.so)" KVATLAS_NATIVE_PATH="$(CURDIR)/$(SAN_SO)" \
	    KVATLAS_ZMQDRAIN_PATH="$(CURDIR)/$(SAN_ZMQ_SO)" \
	    KVATLAS_PAGEHASH_PATH="$(CURDIR)/$(SAN_PH_SO)" \
	    KVATLAS_FUZZ=short $(PY) -m pytest -q -p no:cacheprovider $(SAN_TESTS)
