"""The KV-aware router: policies, the OpenAI proxy, trace replay (docs/end-to-end.md)."""
