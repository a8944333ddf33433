"""`kvatlas router --api openai`: an OpenAI-compatible, KV-aware proxy in front of vLLM / SGLang
engines (or `kvatlas worker`s, which speak the same API). docs/openai.md."""
