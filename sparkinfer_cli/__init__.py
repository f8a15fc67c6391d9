"""sparkinfer: GGUF inference for the Qwen3 family with an OpenAI-compatible server."""

__version__ = "0.1.0"
