"""The producer on a GPU: write-through offload and load-back GB/s through `TieredCache` with the CUDA
transfer engine, against plain torch copies of the same pages in the same run.

    .venv/bin/python -m bench.bench_transfer [--requests 32 --pages 32 --layers 32 --reps 3]

Pages are Llama-8B-shaped by default (16 tokens × 32 layers × K/V × 8 heads × 128 dims, bf16: 2 MiB).
- kvatlas offload: `--requests` prompts of `--pages` pages each are inserted into a write-through
  `TieredCache` (device pool + pinned host pool, `CudaTransferEngine`); timed from the first insert
  until every device → host copy is acknowledged (`wait_transfers`; the GPU/host stores are then
  emitted by `step`, which is included).
- kvatlas load-back: the device copies are evicted (host copies kept), then every prompt is matched
  and `init_load_back` copies its host run to freshly allocated device pages; timed until every
  ack is applied.
- torch: the same device pages and as many host pages, per prompt one gather (`index_select`) and a
  `non_blocking` copy into the pinned pool on a side stream (offload); the reverse (pinned host run →
  device staging → `index_copy_`) for load-back; timed to a stream synchronise.
The bytes loaded back are checked against the bytes written. Best of `--reps` per figure; ratios are
kvatlas / torch (1.0 = as fast as the plain copies). Without a CUDA device it says so and exits 0
(`--cpu-check` runs the same plumbing on CPU pools with the thread engine: a check, not a measurement).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from producer.cache import CacheConfig, TieredCache  # noqa: E402
from producer.pools import KVPool  # noqa: E402
from producer.transfer import CudaTransferEngine, ThreadTransferEngine, cuda_available  # noqa: E402


class Setup:
    """Pools and page shapes for one run; `cuda` False only under --cpu-check."""

    def __init__(self, args: argparse.Namespace, cuda: bool) -> None:
        self.cuda = cuda
        self.page_size = 16
        self.shape = (self.page_size, args.layers, 2, args.kv_heads, args.head_dim)
        self.dtype = torch.bfloat16
        self.requests, self.pages = args.requests, args.pages
        self.total = self.requests * self.pages
        dev = "cuda" if cuda else "cpu"
        # Device pool: the prompts plus as many again for the load-back destinations.
        self.device = KVPool("device", 2 * self.total, self.page_size, self.shape, self.dtype, dev)
        self.host = KVPool("host", self.total, self.page_size, self.shape, self.dtype, "cpu", pin_memory=cuda)
        self.page_bytes = self.device.page_bytes
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.prompts = [torch.randint(0, 150_000, (self.pages * self.page_size,), generator=gen).tolist()
                        for _ in range(self.requests)]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def gbps(self, seconds: float) -> float:
        return self.total * self.page_bytes / seconds / 1e9


def fill(pool: KVPool, pages: list[int], seed: int) -> None:
    """Distinct, reproducible bytes per page (checked after the load-back)."""
    for i, p in enumerate(pages):
        pool.buffer[p].fill_(float((seed * 7919 + i) % 251))


def kvatlas_round(s: Setup, engine: Any) -> tuple[float, float, bool]:
    """(offload s, load-back s, bytes equal) through one fresh TieredCache."""
    cache = TieredCache(CacheConfig(page_size=s.page_size, write_policy="write_through", storage_backup=False),
                        s.device, s.host, engine)
    written: list[list[int]] = []
    for r, toks in enumerate(s.prompts):
        pages = cache.alloc_device(s.pages)
        fill(s.device, pages, r)
        written.append(pages)
    s.sync()
    t0 = time.perf_counter()
    for toks, pages in zip(s.prompts, written):
        cache.insert(toks, pages)
        cache.step()
    cache.wait_transfers(60.0)
    cache.step()
    t_off = time.perf_counter() - t0
    assert cache.evict(s.total) >= s.total, "device copies were not evictable (host copies missing?)"
    matches = [cache.match_prefix(toks) for toks in s.prompts]
    assert all(m.host_len == s.pages * s.page_size for m in matches), "not every page has a host copy"
    t0 = time.perf_counter()
    loaded = []
    for m in matches:
        pages, node = cache.init_load_back(m)
        loaded.append((pages, node))
    cache.wait_transfers(60.0)
    cache.step()
    t_back = time.perf_counter() - t0
    ok = all(cache.is_loaded(node) for _p, node in loaded)
    for r, (pages, _node) in enumerate(loaded):
        want = torch.tensor([float((r * 7919 + i) % 251) for i in range(len(pages))], dtype=s.dtype)
        got = s.device.buffer[torch.tensor(pages, device=s.device.buffer.device)].flatten(1)[:, 0].cpu()
        ok = ok and len(pages) == s.pages and torch.equal(got, want)
    cache.reset()  # every page back to its pool for the next round
    assert s.device.allocator.used == 0 and s.host.allocator.used == 0, "pages leaked across rounds"
    return t_off, t_back, ok


def torch_round(s: Setup) -> tuple[float, float]:
    """The same page counts with plain torch: gather + pinned copy on a side stream, and back."""
    dev, host = s.device.buffer, s.host.buffer
    per = s.pages
    src = [list(range(r * per, (r + 1) * per)) for r in range(s.requests)]
    dst = [list(range(s.total + r * per, s.total + (r + 1) * per)) for r in range(s.requests)]
    stream = torch.cuda.Stream() if s.cuda else None
    ctx: Callable[[], Any] = (lambda: torch.cuda.stream(stream)) if s.cuda else contextlib.nullcontext
    s.sync()
    t0 = time.perf_counter()
    with ctx():
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        keep = []
        for r in range(s.requests):
            idx = torch.tensor(src[r], dtype=torch.long).to(dev.device, non_blocking=True)
            staged = dev.index_select(0, idx)
            host[r * per:(r + 1) * per].copy_(staged, non_blocking=True)
            keep += [idx, staged]
    s.sync()
    t_off = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ctx():
        for r in range(s.requests):
            staged = host[r * per:(r + 1) * per].to(dev.device, non_blocking=True)
            idx = torch.tensor(dst[r], dtype=torch.long).to(dev.device, non_blocking=True)
            dev.index_copy_(0, idx, staged)
            keep += [idx, staged]
    s.sync()
    t_back = time.perf_counter() - t0
    return t_off, t_back


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--pages", type=int, default=32, help="pages per request (16 tokens each)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpu-check", action="store_true",
                    help="no GPU: run the same plumbing on CPU pools with the thread engine (not a measurement)")
    args = ap.parse_args(argv)
    cuda = cuda_available()
    if not cuda and not args.cpu_check:
        print("bench_transfer: no CUDA device (torch.cuda.is_available() is False): nothing measured. "
              "Run it on a machine with a GPU and a CUDA build of torch.")
        return 0
    s = Setup(args, cuda)
    where = torch.cuda.get_device_name() if cuda else "CPU (--cpu-check: plumbing only, not a measurement)"
    print(f"device: {where}; torch {torch.__version__}; {s.requests} requests × {s.pages} pages of "
          f"{s.page_bytes / 2**20:.2f} MiB = {s.total * s.page_bytes / 2**30:.2f} GiB per direction; best of {args.reps}")
    engine = CudaTransferEngine() if cuda else ThreadTransferEngine()
    best = {"k_off": float("inf"), "k_back": float("inf"), "t_off": float("inf"), "t_back": float("inf")}
    exact = True
    try:
        for _ in range(args.reps):  # alternate, so drift on a shared machine hits both the same
            k_off, k_back, ok = kvatlas_round(s, engine)
            t_off, t_back = torch_round(s)
            exact = exact and ok
            for k, v in (("k_off", k_off), ("k_back", k_back), ("t_off", t_off), ("t_back", t_back)):
                best[k] = min(best[k], v)
    finally:
        engine.close()
    print(f"| | kvatlas TieredCache + {type(engine).__name__} | torch gather + {'pinned ' if cuda else ''}copy | "
          "ratio |")
    print("|---|---|---|---|")
    for name, k, t in (("offload (device → host)", "k_off", "t_off"), ("load-back (host → device)", "k_back", "t_back")):
        print(f"| {name} | {s.gbps(best[k]):.2f} GB/s | {s.gbps(best[t]):.2f} GB/s | {best[t] / best[k]:.3f}x |")
    print(f"bytes loaded back equal the bytes written: {exact}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
