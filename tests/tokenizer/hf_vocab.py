"""Test helper: a HF tokenizer.json → GGUF-style tokenizer metadata, the way llama.cpp's
convert_hf_to_gguf.py (`_set_vocab_gpt2` / `get_vocab_base`) writes it (the vocabulary through
sparkinfer's own reader, vocab_override.py; the goldens check it against llama.cpp)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparkinfer_cli.tokenizer.vocab_override import vocab_from_tokenizer_json


def gguf_tokenizer_metadata(tokenizer_json: Path, pre: str, vocab_size: int | None = None,
                            eos_token: str | None = None) -> dict[str, Any]:
    text = Path(tokenizer_json).read_text(encoding="utf-8")
    spec = json.loads(text)
    ids = [*spec["model"]["vocab"].values(), *(a["id"] for a in spec["added_tokens"])]
    tokens, types, merges = vocab_from_tokenizer_json(text, max(vocab_size or 0, max(ids) + 1))
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": tokens.index(eos_token) if eos_token else None,
        "tokenizer.ggml.add_bos_token": False,
    }
