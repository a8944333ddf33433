"""Library a worker embeds: tiered radix cache, transfer engine, L3 backends, event publisher.

Kept import-light on purpose: importing `producer` (or `producer.publisher`) must not import torch,
so the router side and `kvatlas record` never pay for it. Import submodules explicitly.
"""
