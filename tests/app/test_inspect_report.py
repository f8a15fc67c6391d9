"""inspect report against the fixtures' own records: gguf_info.json (written by the fixture
generator from llama.cpp's files), the HF config.json of each tiny model, and gguf's size table."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
from rich.console import Console

from sparkinfer_cli.app.inspect_report import build_report, render_report
from sparkinfer_cli.gguf.reader import GGUFFile

TINY = Path(__file__).parents[1] / "fixtures" / "tiny"
TINY_FILES = sorted(TINY.glob("*/*.gguf"))


def oracle(path: Path) -> tuple[dict, dict]:
    """(this variant's gguf_info.json entry, the family's HF config.json)."""
    info = json.loads((path.parent / "gguf_info.json").read_text())
    variant = next(v for v in info["variants"].values() if v["file"] == path.name)
    return variant, json.loads((path.parent / "hf" / "config.json").read_text())


def ggml_bytes(type_name: str, shape: list[int]) -> int:
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    return math.prod(shape) // block * size


@pytest.mark.parametrize("path", TINY_FILES, ids=lambda p: p.name)
def test_tensor_table_matches_gguf_info(path):
    variant, _ = oracle(path)
    report = build_report(GGUFFile(path), None)
    tensors = variant["tensor_types"]  # name → [type, shape]
    assert report["file"]["size_bytes"] == variant["bytes"]
    assert report["file"]["tensors"] == len(tensors)
    assert report["model"]["parameters"] == sum(math.prod(s) for _, s in tensors.values())
    counts = Counter(t for t, _ in tensors.values())
    type_bytes = Counter()
    for t, shape in tensors.values():
        type_bytes[t] += ggml_bytes(t, shape)
    histogram = report["quantization"]
    assert {r["type"]: r["tensors"] for r in histogram} == dict(counts)
    assert {r["type"]: r["bytes"] for r in histogram} == dict(type_bytes)
    assert [r["bytes"] for r in histogram] == sorted(type_bytes.values(), reverse=True)
    assert report["memory"]["weights_bytes"] == sum(type_bytes.values())
    assert json.loads(json.dumps(report)) == report  # what --json prints


@pytest.mark.parametrize("path", sorted(TINY.glob("*/*-Q8_0.gguf")), ids=lambda p: p.parent.name)
def test_model_structure_and_memory_match_hf_config(path):
    _, hf = oracle(path)
    report = build_report(GGUFFile(path), None)
    model, memory = report["model"], report["memory"]
    kinds = hf.get("layer_types") or ["full_attention"] * hf["num_hidden_layers"]
    n_attention, n_recurrent = kinds.count("full_attention"), kinds.count("linear_attention")
    assert (model["layers"], model["attention_layers"], model["recurrent_layers"]) == \
        (hf["num_hidden_layers"], n_attention, n_recurrent)
    assert (model["heads"], model["kv_heads"], model["head_dim"]) == \
        (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"])
    assert model["context_length"] == hf["max_position_embeddings"] == memory["ctx"]
    assert model["vocab_size"] == hf["vocab_size"]
    n_experts = hf.get("num_experts") or hf.get("num_local_experts")
    if n_experts:
        assert model["experts"] == {"count": n_experts, "used": hf["num_experts_per_tok"],
                                    "expert_ff": hf["moe_intermediate_size"],
                                    "shared_ff": hf.get("shared_expert_intermediate_size")}
    else:
        assert model["experts"] is None
    kv_per_token = 2 * n_attention * hf["num_key_value_heads"] * hf["head_dim"] * 2  # K+V, F16
    assert memory["kv_cache_bytes"] == kv_per_token * hf["max_position_embeddings"]
    assert memory["recurrent_state_bytes"] == n_recurrent * recurrent_state_bytes(hf)
    # the server's state slots: 64 sequences and, by default, 64 prefix-cache snapshots
    state_slots = 128 if n_recurrent else 0
    assert memory["state_pool_bytes"] == state_slots * memory["recurrent_state_bytes"]
    assert memory["total_bytes"] == (memory["weights_bytes"] + memory["kv_cache_bytes"]
                                     + memory["state_pool_bytes"])


def recurrent_state_bytes(hf: dict) -> int:
    """One Gated-DeltaNet layer, F32: conv window over q,k,v channels + the (d_k × d_v) state of
    every value head."""
    if "linear_num_value_heads" not in hf:
        return 0
    h_k, h_v = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    d_k, d_v = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
    conv_channels = 2 * h_k * d_k + h_v * d_v
    return 4 * ((hf["linear_conv_kernel_dim"] - 1) * conv_channels + h_v * d_k * d_v)


def test_tokenizer_and_chat_template_match_hf_files():
    path = TINY / "qwen35moe" / "qwen35moe-Q8_0.gguf"
    tokenizer_config = json.loads((path.parent / "hf" / "tokenizer_config.json").read_text())
    report = build_report(GGUFFile(path), None)
    tok = report["tokenizer"]
    assert (tok["model"], tok["pre"], tok["vocab_size"]) == ("gpt2", "qwen35", 512)
    assert (tok["eos_id"], tok["eos_token"]) == (482, tokenizer_config["eos_token"])
    assert report["chat_template"] == {"present": True,
                                       "length": len(tokenizer_config["chat_template"])}
    assert report["model"]["file_type"] == "Q8_0"


def test_explicit_ctx_scales_the_kv_cache():
    g = GGUFFile(TINY / "qwen3" / "qwen3-Q8_0.gguf")
    full, short = build_report(g, None)["memory"], build_report(g, 1000)["memory"]
    assert short["ctx"] == 1000
    assert short["kv_cache_bytes"] == 1000 * full["kv_bytes_per_token"] == 1000 * 2 * 2 * 2 * 64 * 2
    with pytest.raises(ValueError, match="ctx"):
        build_report(g, 0)


# ---- files with missing or unknown metadata ----------------------------------------------------
def test_the_kv_estimate_counts_the_cache_the_device_allocates(monkeypatch):
    """F16 on the CPU and on CUDA, there int8 with a float32 scale per 32 values under
    SPARKINFER_KV_INT8 (2 layers × 2 kv heads × 64 dims, K and V, a token)."""
    g = GGUFFile(TINY / "qwen3" / "qwen3-Q8_0.gguf")
    values = 2 * 2 * 64 * 2
    per_token = {device: build_report(g, 100, device)["memory"] for device in ("cpu", "cuda")}
    assert per_token["cpu"]["kv_bytes_per_token"] == values * 2
    assert per_token["cuda"]["kv_bytes_per_token"] == values * 2
    assert (per_token["cpu"]["kv_cache_type"], per_token["cuda"]["kv_cache_type"]) == \
        ("F16", "F16")
    monkeypatch.setenv("SPARKINFER_KV_INT8", "1")
    int8 = build_report(g, 100, "cuda")["memory"]
    assert int8["kv_cache_type"] == "int8" and int8["kv_bytes_per_token"] == values * (1 + 4 / 32)
    assert build_report(g, 100, "cpu")["memory"]["kv_cache_type"] == "F16"


def write_gguf(path: Path, arch: str, drop: tuple[str, ...] = ()) -> Path:
    """A one-layer file with an F32 embedding and a Q8_0 matrix; `drop` leaves keys out."""
    keys = {"block_count": 1, "context_length": 2048, "embedding_length": 64,
            "feed_forward_length": 128, "attention.head_count": 2, "attention.head_count_kv": 1,
            "attention.layer_norm_rms_epsilon": 1e-6}
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for suffix, value in keys.items():
        if suffix not in drop:
            adder = writer.add_float32 if isinstance(value, float) else writer.add_uint32
            adder(f"{arch}.{suffix}", value)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(32)])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 31)
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))  # 32 × 64 F32
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((64, 2 * 34), np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # 64 rows × 64 Q8_0 values
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


WEIGHT_BYTES = 32 * 64 * 4 + 64 * 2 * 34


def test_missing_context_length_is_reported_and_assumed(tmp_path):
    report = build_report(GGUFFile(write_gguf(tmp_path / "m.gguf", "qwen3", ("context_length",))),
                          None)
    assert report["model"]["context_length"] is None
    assert report["memory"]["ctx"] == 4096  # ModelConfig's assumption, stated in the warning
    assert any("context_length" in w and "4096" in w for w in report["warnings"])
    assert report["memory"]["kv_cache_bytes"] == 4096 * 2 * 1 * 1 * 32 * 2
    assert report["chat_template"] == {"present": False, "length": 0}


def test_missing_required_key_still_gives_a_report(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "qwen3", ("attention.layer_norm_rms_epsilon",))
    report = build_report(GGUFFile(path), None)
    assert any("layer_norm_rms_epsilon" in w for w in report["warnings"])
    model, memory = report["model"], report["memory"]
    assert (model["layers"], model["heads"], model["kv_heads"]) == (1, 2, 1)
    assert model["parameters"] == 32 * 64 + 64 * 64
    assert memory["kv_cache_bytes"] is None and memory["total_bytes"] == WEIGHT_BYTES
    assert report["tokenizer"]["eos_token"] == "t31"
    json.dumps(report)


def test_unsupported_architecture_still_gives_a_report(tmp_path):
    report = build_report(GGUFFile(write_gguf(tmp_path / "g.gguf", "gemma3")), 512)
    assert report["model"]["architecture"] == "gemma3"
    assert report["model"]["context_length"] == 2048 and report["model"]["layers"] == 1
    assert any("unsupported architecture" in w for w in report["warnings"])
    assert report["memory"]["weights_bytes"] == WEIGHT_BYTES


# ---- rendering ---------------------------------------------------------------------------------
def test_render_shows_every_section(tmp_path):
    console = Console(record=True, width=120)
    render_report(build_report(GGUFFile(TINY / "qwen35moe" / "qwen35moe-Q4_K_M.gguf"), None),
                  console)
    text = console.export_text()
    for needle in ("qwen35moe", "1 attention, 3 Gated-DeltaNet", "4 (2 used)", "Q4_K", "Q5_0",
                   "<|im_end|>", "chat template", "KV cache, 4,096 tokens", "recurrent state",
                   "total"):
        assert needle in text, needle
    console = Console(record=True, width=120)
    render_report(build_report(GGUFFile(write_gguf(tmp_path / "g.gguf", "gemma3")), None), console)
    assert "warning:" in console.export_text()


def test_an_mtp_head_is_shown_beside_the_trunk(tmp_path):
    """A file with a multi-token-prediction layer as llama.cpp's converter writes it (one more
    block, counted in nextn_predict_layers, its tensors named blk.N.nextn.*): inspect names the
    head, the trunk keeps its layer count, and the engine can still run the file."""
    import numpy as np
    from gguf import GGUFValueType as V
    from gguf_corpus import ARCH, N_EMBD, N_LAYER, write_tiny

    head = {f"blk.{N_LAYER}.nextn.{name}.weight": np.ones(N_EMBD, np.float32)
            for name in ("enorm", "hnorm")}
    path = write_tiny(tmp_path / "mtp.gguf", {f"{ARCH}.block_count": (N_LAYER + 1, V.UINT32),
                                              f"{ARCH}.nextn_predict_layers": (1, V.UINT32)},
                      head)
    report = build_report(GGUFFile(path), 256, "cpu")
    assert report["model"]["mtp_head"] == {"layers": 1, "tensors": 2}
    assert report["model"]["layers"] == N_LAYER and report["engine_error"] is None
    console = Console(record=True, width=120)
    render_report(report, console)
    assert "1 layer(s), 2 tensors" in console.export_text()
    plain = build_report(GGUFFile(write_tiny(tmp_path / "plain.gguf")), 256, "cpu")
    assert plain["model"]["mtp_head"] is None
