"""KV memory pools (torch). A pool is one tensor whose dim 0 is the page index, plus an allocator.

The device pool lives on CUDA when present, else on CPU; the host pool is pinned when CUDA is
present (so D2H/H2D copies can be asynchronous) and checks free memory before allocating.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from producer.allocator import PageAllocator, PoolExhausted

__all__ = ["KVPool", "PoolExhausted", "available_host_memory", "kv_page_shape", "make_device_pool", "make_host_pool"]


def kv_page_shape(page_size: int, layer_num: int, head_num: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one page of full-attention KV: (K/V, layer, token, head, dim)."""
    return (2, layer_num, page_size, head_num, head_dim)


class KVPool:
    """A paged tensor plus its allocator. Reading/writing pages is plain tensor indexing."""

    __slots__ = ("name", "page_size", "page_shape", "buffer", "allocator", "_flat")

    def __init__(self, name: str, num_pages: int, page_size: int, page_shape: Sequence[int],
                 dtype: torch.dtype, device: str | torch.device, pin_memory: bool = False) -> None:
        if page_size <= 0:
            raise ValueError(f"{name}: page_size must be positive, got {page_size}")
        self.name = name
        self.page_size = page_size
        self.page_shape = tuple(int(d) for d in page_shape)
        self.allocator = PageAllocator(num_pages, name)
        self.buffer = torch.zeros((num_pages, *self.page_shape), dtype=dtype, device=device,
                                  pin_memory=pin_memory)
        self._flat: memoryview | None = None  # the host buffer as one byte view (page views slice it)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def page_bytes(self) -> int:
        return math.prod(self.page_shape) * self.buffer.element_size()

    def alloc(self, n: int) -> list[int]:
        return self.allocator.alloc(n)

    def free(self, pages: Sequence[int]) -> None:
        self.allocator.free(pages)

    def read_pages(self, pages: Sequence[int]) -> torch.Tensor:
        return self.buffer[list(pages)]

    def write_pages(self, pages: Sequence[int], data: torch.Tensor) -> None:
        self.buffer[list(pages)] = data.to(self.buffer.device, self.buffer.dtype)

    def page_to_bytes(self, page: int) -> bytes:
        """One page as raw bytes (the L3 value)."""
        return self.buffer[page].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()

    def page_view(self, page: int) -> memoryview:
        """One host page's own memory as bytes (no copy): what an L3 backup writes from and a
        prefetch reads into. The caller keeps the page allocated and unchanged while in use."""
        if self._flat is None:
            if self.buffer.device.type != "cpu":
                raise ValueError(f"{self.name}: page views are of host memory")
            self._flat = self.buffer.view(-1).view(torch.uint8).numpy().data
        if not 0 <= page < self.buffer.shape[0]:
            raise IndexError(f"{self.name}: page {page} out of range")
        pb = self.page_bytes
        return self._flat[page * pb:(page + 1) * pb]

    def page_from_bytes(self, page: int, data: bytes) -> None:
        """Write raw bytes into one page; wrong-sized data is refused, never truncated."""
        if len(data) != self.page_bytes:
            raise ValueError(f"{self.name}: page value has {len(data)} bytes, expected {self.page_bytes}")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.buffer.dtype)
        self.buffer[page].copy_(src.view(self.page_shape))


def make_device_pool(num_pages: int, page_size: int, page_shape: Sequence[int],
                     dtype: torch.dtype = torch.float16, device: str | None = None) -> KVPool:
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return KVPool("device pool", num_pages, page_size, page_shape, dtype, dev)


def available_host_memory() -> int:
    """Bytes the kernel reports as available (MemAvailable), falling back to free physical pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def make_host_pool(num_pages: int, page_size: int, page_shape: Sequence[int],
                   dtype: torch.dtype = torch.float16, reserve_bytes: int = 1 << 30,
                   available_bytes: int | None = None) -> KVPool:
    """Host (L2) pool. Refuses, naming the numbers, when it would leave less than `reserve_bytes`
    of host memory; `available_bytes` overrides the probe (tests, containers with odd limits)."""
    page_bytes = math.prod(page_shape) * torch.empty((), dtype=dtype).element_size()
    need = num_pages * page_bytes
    avail = available_host_memory() if available_bytes is None else available_bytes
    if need + reserve_bytes > avail:
        raise MemoryError(
            f"host pool needs {need} bytes ({num_pages} pages x {page_bytes} bytes) plus a "
            f"{reserve_bytes}-byte reserve, but only {avail} bytes of host memory are available"
        )
    return KVPool("host pool", num_pages, page_size, page_shape, dtype, "cpu",
                  pin_memory=torch.cuda.is_available())
