"""load_model: GGUF file → the architecture's Model (the module named like general.architecture)."""

from __future__ import annotations

import importlib
from pathlib import Path

from sparkinfer_cli.gguf_file import GGUFFile
from sparkinfer_cli.model.base import CausalLM
from sparkinfer_cli.model.config import ModelConfig


def load_model(path: str | Path | GGUFFile, device: str = "cpu", *,
               int8_decode: bool = False) -> CausalLM:
    """int8_decode (CPU): decode steps quantize activations to int8 like llama.cpp, ~2x faster;
    off, every op is float32 (what the oracle tests check to 1e-3)."""
    gguf = path if isinstance(path, GGUFFile) else GGUFFile(path)
    config = ModelConfig.from_gguf(gguf)  # refuses unsupported architectures
    if device == "cuda":
        from sparkinfer_cli.model.cuda_runner import load_cuda_model  # imports numba.cuda only here
        return load_cuda_model(gguf, config)
    if device != "cpu":
        raise ValueError(f"device {device!r} is not available in this build (use 'cpu' or 'cuda')")
    module = importlib.import_module(f"sparkinfer_cli.model.{config.arch}")
    model = module.Model(gguf, config)
    if int8_decode:
        model.use_int8_decode()
    return model
