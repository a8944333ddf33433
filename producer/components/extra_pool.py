"""Extra per-page pools that travel with the KV (DeepSeek V3.2 / GLM-5 DSA indexer keys).

An extra pool is indexed by the KV page index itself: page i of the KV and page i of every extra
pool hold the same tokens, on every tier. Copies, L3 backups (key = page hash + the pool's suffix)
and prefetches move them with the KV, all or nothing per page; they never emit events of their
own (group 0's events cover them)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from producer.storage.keys import page_key


class ExtraPool:
    __slots__ = ("name", "suffix", "device", "host", "_flat")

    def __init__(self, name: str, device: torch.Tensor, host: torch.Tensor | None, *, suffix: str | None = None) -> None:
        if host is not None and (host.shape[1:] != device.shape[1:] or host.dtype != device.dtype):
            raise ValueError(f"{name}: host and device page shapes differ")
        self.name = name
        self.suffix = suffix or name
        page_key(0, self.suffix)  # a bad suffix fails here, with the key module's message
        self.device = device
        self.host = host
        self._flat: memoryview | None = None  # the host tensor as one byte view (page views slice it)

    def tensor(self, host: bool) -> torch.Tensor:
        t = self.host if host else self.device
        if t is None:
            raise ValueError(f"{self.name} has no host tensor")
        return t

    def page_to_bytes(self, page: int, host: bool = True) -> bytes:
        return self.tensor(host)[page].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()

    def page_view(self, page: int) -> memoryview:
        """One host page's own memory (no copy), as `KVPool.page_view`."""
        t = self.tensor(True)
        if self._flat is None:
            self._flat = t.view(-1).view(torch.uint8).numpy().data
        if not 0 <= page < t.shape[0]:
            raise IndexError(f"{self.name}: page {page} out of range")
        pb = self.page_bytes()
        return self._flat[page * pb:(page + 1) * pb]

    def page_bytes(self) -> int:
        return self.device[0].numel() * self.device.element_size()

    def page_from_bytes(self, page: int, data: bytes, host: bool = True) -> None:
        t = self.tensor(host)
        if len(data) != self.page_bytes():
            raise ValueError(f"{self.name}: page value has {len(data)} bytes, expected {self.page_bytes()}")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(t.dtype)
        t[page].copy_(src.view(t[page].shape))

    @staticmethod
    def make(name: str, device_pages: int, host_pages: int, page_shape: Sequence[int], dtype: torch.dtype,
             device: str | torch.device, *, suffix: str | None = None) -> ExtraPool:
        dev = torch.zeros((device_pages, *page_shape), dtype=dtype, device=device)
        host = (torch.zeros((host_pages, *page_shape), dtype=dtype, device="cpu",
                            pin_memory=torch.cuda.is_available()) if host_pages else None)
        return ExtraPool(name, dev, host, suffix=suffix)
