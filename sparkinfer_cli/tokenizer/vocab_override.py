"""SPARKINFER_TOKENIZER_URL: the vocabulary and merges from a Hugging Face tokenizer.json.

By default the tokenizer is the GGUF's own (tokenizer.ggml.*). A tokenizer.json (a path relative to
SPARKINFER_ROOT, a file:// or an http(s) URL) can replace its tokens, token types and merges, e.g.
an upstream tokenizer for a GGUF converted with a broken one. They are read the way llama.cpp's
convert_hf_to_gguf.py writes them (`_set_vocab_gpt2`), so the result tokenizes as that GGUF would.
The GGUF keeps the rest (pre-tokenizer rule, special token ids, chat template); the vocabulary must
fit the model's size, since token ids index the embedding rows.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from sparkinfer_cli import env
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.tokenizer.tokenizer import Tokenizer, TokenType

FETCH_TIMEOUT_S = 60


def read_tokenizer_json(location: str, root: str | Path = ".") -> str:
    """The text of the tokenizer.json at a path (relative to root), file:// or http(s) URL."""
    try:
        if location.startswith(("http://", "https://", "file://")):
            with urllib.request.urlopen(location, timeout=FETCH_TIMEOUT_S) as response:
                return response.read().decode("utf-8")
        return (Path(root) / location).read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        raise ValueError(f"SPARKINFER_TOKENIZER_URL={location!r}: cannot read it ({exc})") from None


def looks_special(text: str) -> bool:
    """The converter's `does_token_look_special`: such added tokens become CONTROL."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<｜") and text.endswith("｜>"))
            or (text.startswith("<unused") and text.endswith(">")))


def _added_token(hf: HFTokenizer, added: Mapping[str, Any]) -> tuple[str, int]:
    text = added["content"]
    if not added.get("normalized", True):
        # the converter round-trips unnormalized added tokens through the HF tokenizer
        text = hf.decode(hf.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)
    if added.get("special") or looks_special(text):
        return text, TokenType.CONTROL
    return text.replace("\u2581", " "), TokenType.USER_DEFINED


def vocab_from_tokenizer_json(text: str, size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE tokenizer.json, padded to `size` ids."""
    try:
        spec, hf = json.loads(text), HFTokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises its own Exception type
        raise ValueError(f"not a tokenizer.json: {exc}") from None
    if spec.get("model", {}).get("type") != "BPE":
        raise ValueError("the tokenizer.json has no BPE model")
    entries = {i: (t, int(TokenType.NORMAL)) for t, i in spec["model"]["vocab"].items()}
    for added in spec.get("added_tokens", []):
        entries[added["id"]] = _added_token(hf, added)
    if max(entries) >= size:
        raise ValueError(f"the tokenizer.json has ids up to {max(entries)}, the model "
                         f"{size} tokens")
    padded = [entries.get(i, (f"[PAD{i}]", int(TokenType.UNUSED))) for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    return [t for t, _ in padded], [k for _, k in padded], merges


def metadata_with_vocab(metadata: Mapping[str, Any], tokenizer_json: str) -> dict[str, Any]:
    """GGUF metadata whose tokens, token types and merges come from tokenizer.json's text."""
    tokens, types, merges = vocab_from_tokenizer_json(
        tokenizer_json, len(metadata["tokenizer.ggml.tokens"]))
    return {**metadata, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges}


def load_tokenizer(gguf: GGUFFile, environ: Mapping[str, str] | None = None) -> Tokenizer:
    """The GGUF's tokenizer, or its vocabulary replaced per SPARKINFER_TOKENIZER_URL."""
    location = env.SPARKINFER_TOKENIZER_URL.get(environ)
    if not location:
        return Tokenizer.from_gguf(gguf)
    text = read_tokenizer_json(location, env.SPARKINFER_ROOT.get(environ))
    return Tokenizer.from_metadata(metadata_with_vocab(gguf.metadata, text))
