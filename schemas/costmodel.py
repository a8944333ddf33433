"""The simulated model's cost model: what a `kvatlas worker` runs on and what the routing policies
price requests with (prefill, load-back per tier, decode). A wire type (`kvatlas worker`'s /health,
`kvatlas router --sim`), msgspec only."""
from __future__ import annotations

from msgspec import Struct


class SimModel(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The simulated model's costs. Times are virtual seconds (see docs/end-to-end.md)."""

    name: str = "sim-8b"
    kv_bytes_per_token: int = 131_072          # 32 layers x 8 KV heads x 128 dims x K+V x fp16
    prefill_tokens_per_s: float = 16_000.0     # compute-bound prefill throughput of one worker
    prefill_overhead_s: float = 0.02           # per prefill launch
    decode_s_per_token: float = 0.02           # TPOT
    h2d_bytes_per_s: float = 25e9              # host -> GPU (PCIe 5)
    disk_bytes_per_s: float = 4e9              # local NVMe -> host
    shared_bytes_per_s: float = 6e9            # shared store (RDMA/network) -> host
    max_batch: int = 32                        # running requests (prefill + decode)
    max_queue: int = 1024                      # waiting requests; beyond this /generate answers 503
    # Hybrid models (kvatlas worker --family): what a load-back moves besides the full-attention KV
    mamba_state_bytes: int = 0                 # one Mamba state (conv + temporal, every Mamba layer)
    window_bytes_per_token: int = 0            # sliding-window layers' KV per token (the window's pages)

    def load_s(self, host: int, disk: int, shared: int) -> float:
        """Virtual seconds to bring cached tokens to the GPU (tiers below host go through host)."""
        b = self.kv_bytes_per_token
        return (b * (host + disk + shared) / self.h2d_bytes_per_s + b * disk / self.disk_bytes_per_s
                + b * shared / self.shared_bytes_per_s)

    def load_bytes_s(self, nbytes: int, tier: str) -> float:
        """Virtual seconds to bring `nbytes` from `tier` (host, disk, shared) to the GPU."""
        s = nbytes / self.h2d_bytes_per_s
        if tier == "disk":
            s += nbytes / self.disk_bytes_per_s
        elif tier == "shared":
            s += nbytes / self.shared_bytes_per_s
        return s

    def prefill_s(self, computed: int) -> float:
        return self.prefill_overhead_s + computed / self.prefill_tokens_per_s
