"""generate.GenerationSession: its warm-up takes every path a first request takes, so nothing
compiles (numba or LLVM) while a request is timed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from numba.core.registry import CPUDispatcher

from sparkinfer_cli.app.generate import GenerationSession, GenerationStats, build_prompt
from sparkinfer_cli.engine.sampling_params import SamplingParams
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.kernels.cpu import llvm_jit
from sparkinfer_cli.model.loader import load_runtime_model
from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

TINY = Path(__file__).parents[1] / "fixtures" / "tiny" / "qwen3" / "qwen3-Q4_K_M.gguf"


def compiled_kernels() -> dict[str, int]:
    """Each CPU numba kernel's compiled signatures, and the LLVM kernels built so far."""
    counts = {"llvm": llvm_jit._compile.cache_info().currsize}
    for name, module in list(sys.modules.items()):
        if name.startswith("sparkinfer_cli.kernels.cpu"):
            for attr, value in vars(module).items():
                if isinstance(value, CPUDispatcher):
                    counts[f"{name}.{attr}"] = len(value.signatures)
    return counts


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=4),
                                    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1,
                                                   repetition_penalty=1.2, max_tokens=4)])
def test_after_the_warm_up_short_and_long_prompts_compile_nothing(params, monkeypatch, tmp_path):
    monkeypatch.setenv("SPARKINFER_CACHE_DIR", str(tmp_path))  # the repacked weights
    gguf = GGUFFile(TINY)
    tokenizer = Tokenizer.from_gguf(gguf)
    session = GenerationSession(load_runtime_model(gguf, "cpu"), tokenizer, 256)
    try:
        session.warm_up(params)
        warm = compiled_kernels()
        for text in ("Hi", "a", "The quick brown fox jumps over the lazy dog " * 3):
            ids = build_prompt(tokenizer, text, raw=True, system=None)
            stats = GenerationStats()
            assert list(session.stream(ids, params, stats)) is not None
            assert stats.output_tokens >= 1
        assert compiled_kernels() == warm
    finally:
        session.close()
