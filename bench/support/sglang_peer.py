"""SGLang 0.5.23's own Python `RadixCache`, driven like the kvatlas producer cache in
bench/bench_producer.py (BENCH ONLY — nothing here is imported by the product).

`sglang` is installed `--no-deps` into .venv-bench (bench/setup_bench_env.sh). Importing
`sglang.srt.mem_cache.radix_cache` drags in GPU-only modules the radix cache never calls (triton
kernels, model configs, the GPU memory pools, metrics); those are replaced by inert stubs *only
when they are missing*, and `sglang/__init__` (the frontend language API) is skipped. The cache
code itself, its event recorder, its page hash (SGLang's C++ extension over OpenSSL, JIT-built on
first use) and its msgspec event structs are SGLang's own.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
import types
from array import array
from typing import Any

from bench.support.phases import MatchInsertClock

# Submodules of sglang whose package __init__ pulls in the model zoo; the package is created empty
# so the submodules the radix cache needs still import from the real files.
_HOLLOW = ("sglang", "sglang.srt.configs")
# GPU pools / allocators / metrics the radix cache module imports but the bench never uses (the
# bench passes its own allocator).
_STUBBED = ("sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.allocator",
            "sglang.srt.observability.metrics_collector")


class _AnyMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any

    def __getitem__(cls, key: Any) -> Any:
        return _Any

    def __or__(cls, other: Any) -> Any:
        return _Any

    __ror__ = __or__


class _Any(metaclass=_AnyMeta):
    """Whatever a stubbed module is asked for: a class, a decorator, a type annotation."""

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def __call__(self, *a: Any, **k: Any) -> Any:
        return _Any()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()


class _Stub(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any


def _install(name: str, hollow_root: str | None) -> None:
    if hollow_root is None:
        mod: types.ModuleType = _Stub(name)
        mod.__path__ = []
    else:
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(hollow_root, *name.split(".")[1:])]
    sys.modules[name] = mod


def load_sglang() -> tuple[types.SimpleNamespace | None, str | None, list[str]]:
    """(namespace of the SGLang classes, None, stubbed names) or (None, why not, stubbed names)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None, "sglang is not installed (run bench/setup_bench_env.sh, use .venv-bench/bin/python)", []
    root = list(spec.submodule_search_locations)[0]
    import torch  # noqa: F401  - before any stub, so torch sees the real world (no triton)
    import torch._dynamo  # noqa: F401

    stubbed: list[str] = []

    def fresh() -> None:
        for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
            del sys.modules[k]
        for n in _HOLLOW:
            _install(n, root)
        for n in _STUBBED:
            _install(n, None)

    fresh()
    for _ in range(100):
        try:
            rc = importlib.import_module("sglang.srt.mem_cache.radix_cache")
            base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
            ev = importlib.import_module("sglang.srt.disaggregation.kv_events")
            nh = importlib.import_module("sglang.srt.mem_cache.cpp_utils.native_hash")
            break
        except ModuleNotFoundError as exc:  # a heavy optional dependency: stub it and retry
            if not exc.name or exc.name.startswith("sglang"):
                return None, f"cannot import SGLang's radix cache: {exc!r}", stubbed
            stubbed.append(exc.name)
            parts = exc.name.split(".")
            for i in range(1, len(parts) + 1):
                if ".".join(parts[:i]) not in sys.modules:
                    _install(".".join(parts[:i]), None)
            fresh()
        except Exception as exc:  # noqa: BLE001 - reported verbatim in the bench output
            return None, f"cannot import SGLang's radix cache: {exc!r}", stubbed
    else:
        return None, "too many missing modules", stubbed
    try:
        nh._load_native_hash_module()  # JIT build of SGLang's C++ page hash (OpenSSL)
    except Exception as exc:  # noqa: BLE001
        return None, f"SGLang's native page hash did not build: {exc!r} (cause: {exc.__cause__!r})", stubbed
    ns = types.SimpleNamespace(RadixCache=rc.RadixCache, RadixKey=rc.RadixKey, CacheInitParams=rc.CacheInitParams,
                               MatchPrefixParams=base.MatchPrefixParams, InsertParams=base.InsertParams,
                               EvictParams=base.EvictParams, KVEventBatch=ev.KVEventBatch)
    return ns, None, stubbed


class SlotAllocator:
    """Token-slot allocator with the surface RadixCache calls (free / free_segment / device)."""

    def __init__(self, size: int) -> None:
        import torch

        self.device = "cpu"
        self._torch = torch
        self.free_slots = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int):  # noqa: ANN201
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return self._torch.tensor(out, dtype=self._torch.int64)

    def free(self, indices) -> None:  # noqa: ANN001
        self.free_slots.extend(indices.tolist())

    def free_segment(self, indices, start_pos: int = 0) -> None:  # noqa: ANN001
        self.free(indices[start_pos:])


def run_sglang(sg: types.SimpleNamespace, requests: list[list[int]], page_size: int, events: bool,
               device_tokens: int, times: list[float] | None = None) -> tuple[float, float, list[int]]:
    """(inserts/s, matches/s, first stored block ids) with the same per-request steps as the kvatlas
    bench: match, lock, evict + allocate the new pages, unlock, insert, then (events on) take the
    recorder's events and msgpack-encode the batch as SGLang's publisher does. `times` collects
    each request's insert time."""
    import msgspec
    import torch

    alloc = SlotAllocator(device_tokens)
    cache = sg.RadixCache(sg.CacheInitParams(disable=False, req_to_token_pool=None,
                                             token_to_kv_pool_allocator=alloc, page_size=page_size,
                                             enable_kv_cache_events=events))
    enc = msgspec.msgpack.Encoder()
    phases = MatchInsertClock(times)
    first_ids: list[int] = []
    clock = time.perf_counter
    for tokens in requests:
        key = sg.RadixKey(array("I", tokens))
        t0 = clock()
        m = cache.match_prefix(sg.MatchPrefixParams(key=key))
        t1 = clock()
        node = m.last_device_node
        matched = cache.path_device_indices(node) if m.device_prefix_len else torch.empty(0, dtype=torch.int64)
        need = len(tokens) // page_size * page_size - m.device_prefix_len
        cache.inc_lock_ref(node)
        if alloc.available_size() < need:
            cache.evict(sg.EvictParams(num_tokens=need - alloc.available_size()))
        new = alloc.alloc(need)
        cache.dec_lock_ref(node)
        value = torch.cat([matched, new])
        res = cache.insert(sg.InsertParams(key=key, value=value))
        if res.prefix_len > m.device_prefix_len:  # KV already cached: free the duplicate slots
            alloc.free(value[m.device_prefix_len:res.prefix_len])
        if events:
            evs = cache.kv_events.take()
            if evs:
                enc.encode(sg.KVEventBatch(ts=time.time(), events=evs))
                if not first_ids:
                    first_ids = [h for e in evs if type(e).__name__ == "BlockStored" for h in e.block_hashes]
        t2 = clock()
        phases.add(t0, t1, t2)
    return (*phases.rates(len(requests)), first_ids)
