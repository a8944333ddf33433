"""The KV-aware router: policies, forwarder, trace replay (docs/end-to-end.md)."""
