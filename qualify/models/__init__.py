"""Models: sources (tiny-qwen3, SmolLM2 GGUF, local HF), the manifest, the role loaders."""
