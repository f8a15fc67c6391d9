"""Test helper: a HF tokenizer.json → GGUF-style tokenizer metadata, the way llama.cpp's
convert_hf_to_gguf.py (`_set_vocab_gpt2` / `get_vocab_base`) writes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


def looks_special(text: str) -> bool:
    """The converter's `does_token_look_special`: such added tokens become CONTROL."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<｜") and text.endswith("｜>"))
            or (text.startswith("<unused") and text.endswith(">")))


def _added_token_entry(hf: HFTokenizer, added: dict[str, Any]) -> tuple[str, int]:
    text = added["content"]
    if not added.get("normalized", True):
        # the converter round-trips unnormalized added tokens through the HF tokenizer
        text = hf.decode(hf.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)
    if added.get("special") or looks_special(text):
        return text, CONTROL
    return text.replace("\u2581", " "), USER_DEFINED


def gguf_tokenizer_metadata(tokenizer_json: Path, pre: str, vocab_size: int | None = None,
                            eos_token: str | None = None) -> dict[str, Any]:
    spec = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    hf = HFTokenizer.from_file(str(tokenizer_json))
    vocab = spec["model"]["vocab"]
    entries: dict[int, tuple[str, int]] = {i: (t, NORMAL) for t, i in vocab.items()}
    for added in spec["added_tokens"]:
        entries[added["id"]] = _added_token_entry(hf, added)
    size = max(vocab_size or 0, max(entries) + 1)
    padded = [entries.get(i, (f"[PAD{i}]", UNUSED)) for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    text_to_id = {t: i for i, (t, _) in entries.items()}
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": [t for t, _ in padded],
        "tokenizer.ggml.token_type": [k for _, k in padded],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": text_to_id.get(eos_token) if eos_token else None,
        "tokenizer.ggml.add_bos_token": False,
    }
