"""Synthetic GGUF writer: checked against the anchors page, the llama-quantize outputs in
tests/fixtures/tiny, gguf-py's reader and dequantizer, and HF tokenizers."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from sparkinfer_cli.gguf import synthetic as S
from sparkinfer_cli.gguf.ggml_types import COMPUTE_TYPES, GGMLType
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.kernels.cpu.moe_routing import route
from sparkinfer_cli.model.config import ModelConfig
from sparkinfer_cli.tokenizer.detokenizer import IncrementalDetokenizer
from sparkinfer_cli.tokenizer.tokenizer import Tokenizer as GGUFTokenizer
from sparkinfer_cli.tokenizer.tokenizer import TokenType

FAMILIES = ("qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next")  # with oracle fixtures
TINY = (*FAMILIES, "qwen2", "llama")
FIXTURES = Path(__file__).parents[1] / "fixtures"
GIB = 2**30
WEIGHT_RMS = (0.025, 0.06)  # "RMS ≈ 0.03–0.05" with per-block scale spread


# ---- full-size presets vs shared/anchors/llamacpp-h200.md ----------------------------------------
def test_qwen36_preset_matches_the_anchor_file():
    s = S.preset_summary("qwen3.6-35b-a3b")
    assert s["arch"] == "qwen35moe" and s["n_tensors"] == 733
    assert s["types"] == {"F32": 301, "Q8_0": 310, "Q4_K": 81, "Q5_K": 40, "Q6_K": 1}
    assert round(s["n_params"] / 1e9, 2) == 34.66  # llama.cpp: "34.66 B"
    assert round(s["tensor_bytes"] / GIB, 2) == 20.26  # llama-bench size column: "20.26 GiB"
    assert abs(s["file_bytes"] / 21.76e9 - 1) < 0.01


def test_qwen3_30b_preset_matches_the_anchor_file():
    s = S.preset_summary("qwen3-30b-a3b")
    assert s["arch"] == "qwen3moe" and s["n_tensors"] == 579
    assert s["types"] == {"F32": 241, "Q4_K": 289, "Q6_K": 49}
    assert round(s["n_params"] / 1e9, 2) == 30.53
    assert round(s["tensor_bytes"] / GIB, 2) == 17.28
    assert abs(s["file_bytes"] / 18.55e9 - 1) < 0.01
    # anchors: attn_v and ffn_down_exps are Q6_K in layers 0–5, 8, 11, …, 41, 42–47
    want = set(range(6)) | set(range(8, 42, 3)) | set(range(42, 48))
    for suffix in ("attn_v.weight", "ffn_down_exps.weight"):
        q6 = {int(t.name.split(".")[1]) for t in S.tensor_plan("qwen3-30b-a3b")
              if t.name.endswith(suffix) and t.ggml_type == GGMLType.Q6_K}
        assert q6 == want, suffix


# ---- tiny presets --------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_plan_equals_llama_quantize_q4_k_m_fixture(family):
    """Same dims as the oracle fixtures, so names, shapes and llama-quantize's per-tensor Q4_K_M
    choices (incl. the Q5_0/Q8_0 row fallbacks) must equal the fixture file's table."""
    info = json.loads((FIXTURES / "tiny" / family / "gguf_info.json").read_text())
    want = {name: (t, list(shape))
            for name, (t, shape) in info["variants"]["Q4_K_M"]["tensor_types"].items()}
    got = {t.name: (t.ggml_type.name, list(t.shape)) for t in S.tensor_plan(f"tiny-{family}")}
    assert got == want


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("synthetic")
    return {f: S.write_synthetic(out / f"tiny-{f}.gguf", f"tiny-{f}", seed=1) for f in TINY}


@pytest.mark.parametrize("family", TINY)
def test_tiny_file_reads_back_as_declared(family, tiny_files):
    path, spec = tiny_files[family], S.PRESETS[f"tiny-{family}"]
    f = GGUFFile(path)
    plan = S.tensor_plan(spec)
    assert [(n, t.shape, t.ggml_type) for n, t in f.tensors.items()] == \
        [(t.name, t.shape, t.ggml_type) for t in plan]
    assert path.stat().st_size == S.preset_summary(spec)["file_bytes"]
    cfg = ModelConfig.from_gguf(f)
    assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.n_vocab) == (family, spec.n_layer, 256, 512)
    assert (cfg.n_expert, cfg.n_expert_used, cfg.tied_embeddings) == \
        (spec.n_expert, spec.n_expert_used, spec.tied_embeddings)
    if spec.is_hybrid:
        assert cfg.recurrent_layers == tuple(spec.is_recurrent(i) for i in range(spec.n_layer))
        assert (cfg.ssm_n_group, cfg.ssm_n_v_heads) == (2, 4)  # H_k ≠ H_v
    name = "blk.0.attn_norm.weight"
    np.testing.assert_array_equal(f.raw(name), S.tensor_data(spec, name, seed=1))


@pytest.mark.parametrize("family", TINY)
def test_tiny_weights_dequantize_to_realistic_values(family, tiny_files):
    reader = gguf.GGUFReader(tiny_files[family])
    for t in reader.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        assert np.isfinite(x).all() and np.any(x != 0), t.name
        check_value_range(t.name, t.tensor_type, x)


def check_value_range(name, ggml_type, x):
    rms = float(np.sqrt(np.mean(x ** 2)))
    if name.endswith("_norm.weight"):
        assert 0.85 < x.min() and x.max() < 1.15, name
    elif name.endswith("ssm_a"):
        assert (x < 0).all(), name
    elif ggml_type != gguf.GGMLQuantizationType.F32 and x.size >= 32 * 256:  # enough blocks
        assert WEIGHT_RMS[0] < rms < WEIGHT_RMS[1], f"{name} {ggml_type.name} rms={rms:.4f}"
    elif ggml_type != gguf.GGMLQuantizationType.F32:
        assert 0.01 < rms < 0.1 and np.abs(x).max() < 1.0, f"{name} {ggml_type.name} rms={rms:.4f}"


def test_every_compute_type_has_realistic_random_blocks():
    """Each quantized type: random blocks dequantized by gguf-py are finite, centred (Q4_0 and
    IQ4_NL codes are slightly asymmetric), RMS ≈ 0.03–0.05."""
    assert set(S.BLOCK_SCALES) | {GGMLType.F32, GGMLType.F16, GGMLType.BF16} == COMPUTE_TYPES
    rng = np.random.default_rng(0)
    for t in S.BLOCK_SCALES:
        blocks = S.random_blocks(t, 2048, rng)
        x = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(int(t))).astype(np.float64)
        rms = float(np.sqrt(np.mean(x ** 2)))
        assert np.isfinite(x).all(), t.name
        assert WEIGHT_RMS[0] < rms < WEIGHT_RMS[1] and abs(x.mean()) < 0.15 * rms, \
            f"{t.name}: rms={rms:.4f} mean={x.mean():.5f}"


def test_all_types_recipe_writes_every_compute_type(tmp_path):
    spec = dataclasses.replace(S.PRESETS["tiny-qwen35moe"], recipe="all-types")
    path = S.write_synthetic(tmp_path / "all.gguf", spec)
    reader = gguf.GGUFReader(path)
    assert {GGMLType(int(t.tensor_type)) for t in reader.tensors} == COMPUTE_TYPES
    for t in reader.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        assert np.isfinite(x).all() and np.any(x != 0), t.name
        check_value_range(t.name, t.tensor_type, x)


def test_write_streams_in_chunks_with_progress(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "CHUNK_BYTES", 4096)
    seen: list[tuple[int, int]] = []
    path = S.write_synthetic(tmp_path / "t.gguf", "tiny-qwen3moe",
                             progress=lambda done, total: seen.append((done, total)))
    size = path.stat().st_size
    assert len(seen) > 2 * len(S.tensor_plan("tiny-qwen3moe"))  # several chunks per big tensor
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:])) and seen[-1][0] <= size
    assert {n for _, n in seen} == {size} and not list(tmp_path.glob("*.partial"))


# ---- tokenizer and routing -----------------------------------------------------------------------
@pytest.mark.parametrize("preset,eos_id", [("tiny-qwen3", 482), ("qwen3-30b-a3b", 151645),
                                           ("qwen3.6-35b-a3b", 248046)])
def test_vocabulary_is_a_valid_byte_level_bpe(preset, eos_id):
    spec = S.PRESETS[preset]
    tokens, types, merges = S.vocabulary(spec)
    assert len(tokens) == len(types) == spec.n_vocab == len(set(tokens))
    assert tokens[eos_id] == "<|im_end|>" and types[eos_id] == 3
    assert tokens[spec.special_token_base] == "<|endoftext|>"
    assert tokens[S.SPECIAL_TOKENS.index("<think>") + spec.special_token_base] == "<think>"
    vocab = {tok: i for i, tok in enumerate(tokens)}
    assert all(a in vocab and b in vocab and a + b in vocab
               for a, b in (m.split(" ") for m in merges))
    tok = Tokenizer(models.BPE(vocab, [tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = "{%- if messages %}\n    naïve café 42 — 日本\t<x>"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text and len(ids) < len(text.encode())  # merges apply


def starts_a_character(piece: bytes) -> bool:
    """A lone UTF-8 lead byte (a byte token): every streaming detokenizer holds it back until the
    token after it."""
    return len(piece) == 1 and 0xC2 <= piece[0] <= 0xF4


def check_normal_tokens_print(tokenizer: GGUFTokenizer, ids: list[int]) -> None:
    """Each id decodes to text and streams it as soon as it is pushed; the made-up words (past
    the byte tokens and merges) are visible text."""
    num_bpe = len(S.bpe_vocab()[0])
    stream = IncrementalDetokenizer(tokenizer, skip_special=True)
    for token_id in ids:
        text, piece = tokenizer.decode([token_id]), tokenizer.token_bytes(token_id)
        assert tokenizer.token_types[token_id] == TokenType.NORMAL and text, token_id
        if starts_a_character(piece):
            assert stream.push(token_id) == "" and stream.flush() == text
            continue
        assert stream.push(token_id) == text, token_id
        if token_id >= num_bpe:
            assert text.startswith(" ") and text[1:].isalpha() and text.isprintable(), text


def test_every_normal_token_of_a_written_file_prints_as_it_streams(tmp_path):
    """A tiny model with room for made-up words between the merges and the specials: every
    normal id, read back through GGUFFile (and the gguf package)."""
    spec = dataclasses.replace(S.PRESETS["tiny-qwen3"], name="wide-vocab", n_vocab=2048,
                               special_token_base=1024)
    path = S.write_synthetic(tmp_path / "wide.gguf", spec)
    field = gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"]
    assert len(field.data) == spec.n_vocab
    tokenizer = GGUFTokenizer.from_gguf(GGUFFile(path))
    special = range(spec.special_token_base, spec.special_token_base + len(S.SPECIAL_TOKENS))
    normal = [i for i in range(spec.n_vocab) if i not in special]
    check_normal_tokens_print(tokenizer, normal)
    assert sum(starts_a_character(tokenizer.token_bytes(i)) for i in normal) == 0xF4 - 0xC2 + 1
    assert tokenizer.decode(tokenizer.encode("naïve café ba")) == "naïve café ba"


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3.6-35b-a3b"])
def test_full_size_vocabulary_prints_a_sample_of_its_normal_tokens(preset):
    spec = S.PRESETS[preset]
    tokens, types, merges = S.vocabulary(spec)
    tokenizer = GGUFTokenizer(tokens, types, merges, spec.tokenizer_pre)
    normal = [i for i, t in enumerate(types) if t == TokenType.NORMAL]
    assert len(normal) == spec.n_vocab - len(S.SPECIAL_TOKENS)
    check_normal_tokens_print(tokenizer, random.Random(0).sample(normal, 3000) + normal[-300:])


def test_chat_template_is_qwen3s():
    goldens = json.loads((FIXTURES / "chat" / "chat_template_goldens.json").read_text())
    assert S.QWEN3_CHAT_TEMPLATE == goldens["templates"]["qwen3"]["text"]


@pytest.mark.parametrize("preset", ["qwen3.6-35b-a3b", "qwen3-30b-a3b", "tiny-qwen3moe",
                                    "tiny-qwen35moe", "tiny-qwen3next"])
def test_routing_over_random_tokens_picks_every_expert(preset):
    spec = S.PRESETS[preset]
    router = S.tensor_data(spec, "blk.0.ffn_gate_inp.weight")  # (n_expert, n_embd) f32
    x = np.random.default_rng(3).standard_normal((500, spec.n_embd)).astype(np.float32)
    ids, _ = route(x @ router.T, spec.n_expert_used)
    counts = np.bincount(ids.ravel(), minlength=spec.n_expert)
    assert (counts > 0).all(), f"experts never picked: {np.flatnonzero(counts == 0)}"


def test_bad_presets_are_refused():
    with pytest.raises(ValueError, match="unknown synthetic preset"):
        S.preset_summary("qwen9")
    with pytest.raises(ValueError, match="H_v"):
        dataclasses.replace(S.PRESETS["tiny-qwen35"], ssm_n_v_heads=3)
