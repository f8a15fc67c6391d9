"""Streaming detokenizer: never a broken UTF-8 piece, and the stream adds up to decode()."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_tokenizers import tokenizer_from_gguf, tokenizer_goldens

from sparkinfer_cli.tokenizer.detokenizer import IncrementalDetokenizer
from sparkinfer_cli.tokenizer.tokenizer import BYTE_TO_CHAR, Tokenizer


@pytest.fixture(scope="module")
def qwen25(demo_model_path) -> Tokenizer:
    return tokenizer_from_gguf(demo_model_path("qwen2.5-coder-0.5b"))


def stream(tok: Tokenizer, ids: list[int], skip_special: bool = False) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special=skip_special)
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_emoji_and_cjk_split_across_tokens(qwen25):
    text = "🫠 龘 𓀀 👩\u200d👩\u200d👧 ok"
    ids = qwen25.encode(text)
    # the test only means something if some tokens hold partial characters
    assert any(not _is_utf8(qwen25.token_bytes(i)) for i in ids)
    pieces = stream(qwen25, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_every_golden_string_streams_to_llama_cpp_text(qwen25):
    for case in tokenizer_goldens()["cases"]:
        golden = case["llamacpp_qwen25coder"]
        pieces = stream(qwen25, golden["ids_special"])
        assert "".join(pieces) == golden["detok_special"], case["id"]
        if "\ufffd" not in case["text"]:
            assert all("\ufffd" not in p for p in pieces), case["id"]


def test_skip_special_stream_equals_decode(qwen25):
    ids = qwen25.encode('<|im_start|>assistant\n<tool_call>\n{"a": "é"}\n</tool_call><|im_end|>')
    assert "".join(stream(qwen25, ids, skip_special=True)) == qwen25.decode(ids, skip_special=True)
    assert "<|im_end|>" not in qwen25.decode(ids, skip_special=True)


def test_incomplete_character_at_end_is_replaced_on_flush(qwen25):
    ids = qwen25.encode("龘")[:1]  # first token holds 2 of the 3 bytes
    detok = IncrementalDetokenizer(qwen25)
    assert detok.push(ids[0]) == ""
    assert detok.flush() == qwen25.decode(ids) == "\ufffd"


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
def test_stream_equals_decode_for_any_text(qwen25, text):
    ids = qwen25.encode(text, parse_special=False)
    assert "".join(stream(qwen25, ids)) == qwen25.decode(ids) == text


# ---- vocabularies with llama.cpp's space clean-up (llama-bpe) ----------------------------------
@pytest.fixture(scope="module")
def byte_llama3() -> Tokenizer:
    """One token per byte, pre 'llama-bpe' (which cleans up spaces on decode)."""
    return Tokenizer.from_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": [BYTE_TO_CHAR[b] for b in range(256)],
        "tokenizer.ggml.token_type": [1] * 256, "tokenizer.ggml.merges": [],
        "tokenizer.ggml.add_bos_token": False})


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=" ',.?!smrevtdl", max_size=30))
def test_space_clean_up_streams_like_whole_text(byte_llama3, text):
    ids = [ord(c) for c in text]
    assert "".join(stream(byte_llama3, ids)) == byte_llama3.decode(ids)


def test_space_clean_up_example(byte_llama3):
    ids = [ord(c) for c in "Yes , it 's fine !"]
    assert "".join(stream(byte_llama3, ids)) == "Yes, it's fine!"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
