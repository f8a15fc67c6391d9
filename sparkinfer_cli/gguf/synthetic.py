"""Synthetic GGUF models: real tensor names, shapes, metadata and quant types; random valid weights.

Tests use the tiny presets (the dimensions of tests/fixtures/tiny); `sparkinfer bench` uses the
full-size presets, which match the files behind shared/anchors/llamacpp-h200.md (tensor count, type
mix, size). Writing streams: the header (metadata + tensor table) first, then each tensor generated
and written in chunks, so a 20 GB file never sits in memory.

Weights: quantized blocks are random bytes whose fp16 scale fields are overwritten from ranges that
give a dequantized RMS ≈ 0.03–0.05, like real checkpoints (larger scales overflow f16 activations
and make routing degenerate). Norms ≈ 1, ssm_a < 0, routers N(0, 1/n_embd) so routing spreads.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import struct
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sparkinfer_cli.gguf.ggml_types import BLOCK_GEOMETRY, COMPUTE_TYPES, GGMLType, tensor_bytes

ARCHITECTURES = ("qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next", "qwen2", "llama")
HYBRID_ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next")
MOE_ARCHITECTURES = ("qwen3moe", "qwen35moe", "qwen3next")
SHARED_EXPERT_ARCHITECTURES = ("qwen35moe", "qwen3next")
RECIPES = ("q4_k_m", "ud-q4_k_m", "q8_0", "f32", "all-types")
ALIGNMENT = 32
CHUNK_BYTES = 32 << 20  # generated and written at a time
N_MERGES = 224  # BPE merges of the built-in tokenizer (as many as the tiny fixtures have)

Progress = Callable[[int, int], None]  # (bytes written, file bytes)

SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)  # Qwen's added tokens in id order (151643… for Qwen3, 248044… for Qwen3.5/3.6)


# ---- specification -------------------------------------------------------------------------------
@dataclass(frozen=True)
class SyntheticSpec:
    """Everything that decides a synthetic file except the random seed."""

    name: str
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_base: float
    context_length: int
    special_token_base: int  # id of <|endoftext|>; the other Qwen special tokens follow it
    tied_embeddings: bool = False
    n_ff: int = 0  # dense FFN width (qwen3moe/qwen3next: HF intermediate_size, unused)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    n_rot: int = 0  # hybrids: rotary dims per head (0: head_dim)
    rope_sections: tuple[int, ...] = ()  # qwen35*: IMROPE sections
    ssm_conv_kernel: int = 4
    ssm_d_state: int = 0  # head_k_dim = head_v_dim
    ssm_n_group: int = 0  # H_k
    ssm_n_v_heads: int = 0  # H_v
    full_attention_interval: int = 4
    rms_eps: float = 1e-6
    recipe: str = "q4_k_m"
    mtp_layers: int = 0  # NextN / MTP blocks after the trunk (qwen35*: llama.cpp's layout)
    head_only: bool = False  # the MTP blocks without the trunk's (convert_hf_to_gguf.py --mtp)

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.arch!r} (known: {ARCHITECTURES})")
        if self.recipe not in RECIPES:
            raise ValueError(f"unknown quant recipe {self.recipe!r} (known: {RECIPES})")
        if self.is_moe and not 0 < self.n_expert_used <= self.n_expert:
            raise ValueError(f"{self.arch} needs 0 < n_expert_used <= n_expert")
        if self.is_hybrid and (self.ssm_n_group <= 0 or self.ssm_n_v_heads % self.ssm_n_group):
            raise ValueError("hybrid models need H_v (ssm_n_v_heads) to be a multiple of "
                             "H_k (ssm_n_group)")
        if self.mtp_layers and not self.arch.startswith("qwen35"):
            raise ValueError("MTP heads are written for the qwen35 architectures only")
        if self.head_only and not self.mtp_layers:
            raise ValueError("a head-only file needs mtp_layers")
        if not 256 <= self.special_token_base <= self.n_vocab - len(SPECIAL_TOKENS):
            raise ValueError(f"special_token_base must leave room for 256 byte tokens and "
                             f"{len(SPECIAL_TOKENS)} special tokens in n_vocab={self.n_vocab}")

    @property
    def is_hybrid(self) -> bool:
        return self.arch in HYBRID_ARCHITECTURES

    @property
    def is_moe(self) -> bool:
        return self.arch in MOE_ARCHITECTURES

    @property
    def tokenizer_pre(self) -> str:
        return "qwen35" if self.arch.startswith("qwen35") else "qwen2"

    def is_recurrent(self, layer: int) -> bool:
        return self.is_hybrid and (layer + 1) % self.full_attention_interval != 0


_TINY = {"n_embd": 256, "n_vocab": 512, "n_head": 4, "head_dim": 64, "context_length": 4096,
         "special_token_base": 480}
_TINY_HYBRID = dict(_TINY, rope_base=1e7, n_rot=16, ssm_d_state=64, ssm_n_group=2,
                    ssm_n_v_heads=4)

PRESETS: dict[str, SyntheticSpec] = {
    "qwen3.6-35b-a3b": SyntheticSpec(
        name="Qwen3.6-35B-A3B (synthetic)", arch="qwen35moe", n_layer=40, n_embd=2048,
        n_vocab=248320, n_head=16, n_head_kv=2, head_dim=256, rope_base=1e7,
        context_length=262144, special_token_base=248044, n_expert=256, n_expert_used=8,
        n_ff_exp=512, n_ff_shexp=512, n_rot=64, rope_sections=(11, 11, 10, 0), ssm_d_state=128,
        ssm_n_group=16, ssm_n_v_heads=32, recipe="ud-q4_k_m"),
    "qwen3-30b-a3b": SyntheticSpec(
        name="Qwen3-30B-A3B (synthetic)", arch="qwen3moe", n_layer=48, n_embd=2048,
        n_vocab=151936, n_head=32, n_head_kv=4, head_dim=128, rope_base=1e6,
        context_length=40960, special_token_base=151643, n_ff=6144, n_expert=128,
        n_expert_used=8, n_ff_exp=768),
    "tiny-qwen3": SyntheticSpec(name="tiny-qwen3", arch="qwen3", n_layer=2, n_head_kv=2,
                                rope_base=1e6, n_ff=256, tied_embeddings=True, **_TINY),
    "tiny-qwen3moe": SyntheticSpec(name="tiny-qwen3moe", arch="qwen3moe", n_layer=2, n_head_kv=2,
                                   rope_base=1e6, n_ff=768, n_expert=8, n_expert_used=2,
                                   n_ff_exp=64, **_TINY),
    "tiny-qwen35": SyntheticSpec(name="tiny-qwen35", arch="qwen35", n_layer=2, n_head_kv=2,
                                 n_ff=256, tied_embeddings=True, rope_sections=(3, 3, 2, 0),
                                 full_attention_interval=2, **_TINY_HYBRID),
    "tiny-qwen35moe": SyntheticSpec(name="tiny-qwen35moe", arch="qwen35moe", n_layer=4,
                                    n_head_kv=1, n_expert=4, n_expert_used=2, n_ff_exp=64,
                                    n_ff_shexp=256, rope_sections=(3, 3, 2, 0), **_TINY_HYBRID),
    "tiny-qwen35-mtp": SyntheticSpec(name="tiny-qwen35-mtp", arch="qwen35", n_layer=2, n_head_kv=2,
                                     n_ff=256, tied_embeddings=True, rope_sections=(3, 3, 2, 0),
                                     full_attention_interval=2, mtp_layers=1, **_TINY_HYBRID),
    "tiny-qwen35moe-mtp": SyntheticSpec(name="tiny-qwen35moe-mtp", arch="qwen35moe", n_layer=4,
                                        n_head_kv=1, n_expert=4, n_expert_used=2, n_ff_exp=64,
                                        n_ff_shexp=256, rope_sections=(3, 3, 2, 0), mtp_layers=1,
                                        **_TINY_HYBRID),
    "tiny-qwen2": SyntheticSpec(name="tiny-qwen2", arch="qwen2", n_layer=2, n_head_kv=2,
                                rope_base=1e6, n_ff=512, tied_embeddings=True, **_TINY),
    "tiny-llama": SyntheticSpec(name="tiny-llama", arch="llama", n_layer=2, n_head_kv=2,
                                rope_base=1e4, n_ff=512, tied_embeddings=True, **_TINY),
    "tiny-qwen3next": SyntheticSpec(name="tiny-qwen3next", arch="qwen3next", n_layer=2,
                                    n_head_kv=1, n_ff=512, n_expert=4, n_expert_used=2,
                                    n_ff_exp=64, n_ff_shexp=256, full_attention_interval=2,
                                    **_TINY_HYBRID),
}


def resolve_preset(preset: str | SyntheticSpec) -> SyntheticSpec:
    if isinstance(preset, SyntheticSpec):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown synthetic preset {preset!r} "
                         f"(known: {', '.join(PRESETS)})") from None


# ---- tensor plan: names and shapes (ARCHITECTURES.md §2.2, §3.2, §4.3) ---------------------------
@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # ggml order: ne0 (contiguous) first
    ggml_type: GGMLType

    @property
    def n_bytes(self) -> int:
        return tensor_bytes(self.ggml_type, self.shape)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


Shapes = list[tuple[str, tuple[int, ...]]]


def tensor_plan(preset: str | SyntheticSpec) -> list[TensorPlan]:
    """Every tensor of the file, in file order, with its ggml type."""
    spec = resolve_preset(preset)
    shapes = _global_shapes(spec)
    for layer in range(spec.n_layer if spec.head_only else 0, spec.n_layer + spec.mtp_layers):
        shapes += _layer_shapes(spec, layer)
    types = _tensor_types(spec, shapes)
    return [TensorPlan(name, shape, t) for (name, shape), t in zip(shapes, types)]


def _global_shapes(s: SyntheticSpec) -> Shapes:
    shapes: Shapes = [("token_embd.weight", (s.n_embd, s.n_vocab)),
                      ("output_norm.weight", (s.n_embd,))]
    if not s.tied_embeddings:
        shapes.append(("output.weight", (s.n_embd, s.n_vocab)))
    return shapes


def _layer_shapes(s: SyntheticSpec, layer: int) -> Shapes:
    ffn_norm = "post_attention_norm.weight" if s.is_hybrid else "ffn_norm.weight"
    is_mtp = layer >= s.n_layer  # a full-attention layer after the NextN projection
    mixer = _gdn_shapes(s) if s.is_recurrent(layer) and not is_mtp else _attention_shapes(s)
    ffn = _moe_shapes(s) if s.is_moe else _dense_ffn_shapes(s)
    local = [("attn_norm.weight", (s.n_embd,)), *mixer, (ffn_norm, (s.n_embd,)), *ffn]
    if is_mtp:
        local += [("nextn.eh_proj.weight", (2 * s.n_embd, s.n_embd)),
                  ("nextn.enorm.weight", (s.n_embd,)), ("nextn.hnorm.weight", (s.n_embd,)),
                  ("nextn.shared_head_norm.weight", (s.n_embd,))]
    return [(f"blk.{layer}.{name}", shape) for name, shape in local]


def _attention_shapes(s: SyntheticSpec) -> Shapes:
    # hybrids: attn_q rows are [query head h | gate head h] per head, hence twice the rows
    q_rows = s.n_head * s.head_dim * (2 if s.is_hybrid else 1)
    kv_rows = s.n_head_kv * s.head_dim
    shapes: Shapes = [("attn_q.weight", (s.n_embd, q_rows)), ("attn_k.weight", (s.n_embd, kv_rows)),
                      ("attn_v.weight", (s.n_embd, kv_rows)),
                      ("attn_output.weight", (s.n_head * s.head_dim, s.n_embd))]
    if s.arch == "qwen2":
        shapes += [("attn_q.bias", (q_rows,)), ("attn_k.bias", (kv_rows,)),
                   ("attn_v.bias", (kv_rows,))]
    elif s.arch != "llama":  # the Qwen3 families normalise q and k per head
        shapes += [("attn_q_norm.weight", (s.head_dim,)), ("attn_k_norm.weight", (s.head_dim,))]
    return shapes


def _gdn_shapes(s: SyntheticSpec) -> Shapes:
    E, H_v, d = s.n_embd, s.ssm_n_v_heads, s.ssm_d_state
    value_dim = H_v * d
    conv_dim = 2 * s.ssm_n_group * d + value_dim
    if s.arch == "qwen3next":
        beta_alpha: Shapes = [("ssm_ba.weight", (E, 2 * H_v))]
    else:
        beta_alpha = [("ssm_beta.weight", (E, H_v)), ("ssm_alpha.weight", (E, H_v))]
    return [("attn_qkv.weight", (E, conv_dim)), ("attn_gate.weight", (E, value_dim)),
            *beta_alpha, ("ssm_conv1d.weight", (s.ssm_conv_kernel, conv_dim)),
            ("ssm_dt.bias", (H_v,)), ("ssm_a", (H_v,)), ("ssm_norm.weight", (d,)),
            ("ssm_out.weight", (value_dim, E))]


def _dense_ffn_shapes(s: SyntheticSpec) -> Shapes:
    return [("ffn_gate.weight", (s.n_embd, s.n_ff)), ("ffn_up.weight", (s.n_embd, s.n_ff)),
            ("ffn_down.weight", (s.n_ff, s.n_embd))]


def _moe_shapes(s: SyntheticSpec) -> Shapes:
    E, ff, n = s.n_embd, s.n_ff_exp, s.n_expert
    shapes: Shapes = [("ffn_gate_inp.weight", (E, n)), ("ffn_gate_exps.weight", (E, ff, n)),
                      ("ffn_up_exps.weight", (E, ff, n)), ("ffn_down_exps.weight", (ff, E, n))]
    if s.arch in SHARED_EXPERT_ARCHITECTURES:
        sh = s.n_ff_shexp
        shapes += [("ffn_gate_inp_shexp.weight", (E,)), ("ffn_gate_shexp.weight", (E, sh)),
                   ("ffn_up_shexp.weight", (E, sh)), ("ffn_down_shexp.weight", (sh, E))]
    return shapes


# ---- quant types (GGUF.md §4: llama-quantize rules) ----------------------------------------------
Q = GGMLType
# llama-quantize's replacement when a row is not a whole number of 256-blocks
_ROW_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.IQ4_XS: Q.IQ4_NL}
_ALL_TYPES = sorted(COMPUTE_TYPES - {Q.F32})


def _is_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """What llama-quantize may quantize; the converter already forced the rest to F32."""
    excluded = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d")
    return len(shape) >= 2 and name.endswith("weight") and not any(x in name for x in excluded)


def _tensor_types(spec: SyntheticSpec, shapes: Shapes) -> list[GGMLType]:
    quantizable = [name for name, shape in shapes if _is_quantizable(name, shape)]
    chosen = dict(zip(quantizable, _RECIPE_RULES[spec.recipe](spec, quantizable)))
    return [_fit_row(chosen[name], shape[0]) if name in chosen else Q.F32
            for name, shape in shapes]


def _fit_row(t: GGMLType, ne0: int) -> GGMLType:
    if ne0 % BLOCK_GEOMETRY[t][0]:
        t = _ROW_FALLBACK.get(t, t)
    return t if ne0 % BLOCK_GEOMETRY[t][0] == 0 else Q.F16


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _q4_k_m(spec: SyntheticSpec, names: list[str]) -> list[GGMLType]:
    attn_v_like = [n for n in names if n.endswith(("attn_v.weight", "attn_qkv.weight"))]
    return [_q4_k_m_type(spec, n, attn_v_like) for n in names]


def _q4_k_m_type(spec: SyntheticSpec, name: str, attn_v_like: list[str]) -> GGMLType:
    eight_experts = spec.n_expert == 8  # llama-quantize's Mixtral special cases
    if name == "output.weight" or (name == "token_embd.weight" and spec.tied_embeddings):
        return Q.Q6_K
    if name in attn_v_like:
        if eight_experts:
            return Q.Q8_0
        return Q.Q6_K if _use_more_bits(attn_v_like.index(name), len(attn_v_like)) else Q.Q4_K
    if "ffn_down" in name:
        return Q.Q6_K if _use_more_bits(int(name.split(".")[1]), spec.n_layer) else Q.Q4_K
    if eight_experts and name.endswith("attn_output.weight"):
        return Q.Q5_K
    if eight_experts and name.endswith("attn_k.weight"):
        return Q.Q8_0
    return Q.Q4_K


def _ud_q4_k_m(spec: SyntheticSpec, names: list[str]) -> list[GGMLType]:
    """The anchors' approximation of unsloth UD-Q4_K_M: experts 4/5-bit, everything else Q8_0."""
    def pick(name: str) -> GGMLType:
        if name == "output.weight" or (name == "token_embd.weight" and spec.tied_embeddings):
            return Q.Q6_K
        if name == "token_embd.weight" or name.endswith(("gate_exps.weight", "up_exps.weight")):
            return Q.Q4_K
        return Q.Q5_K if name.endswith("ffn_down_exps.weight") else Q.Q8_0
    return [pick(n) for n in names]


_RECIPE_RULES: dict[str, Callable[[SyntheticSpec, list[str]], list[GGMLType]]] = {
    "q4_k_m": _q4_k_m,
    "ud-q4_k_m": _ud_q4_k_m,
    "q8_0": lambda spec, names: [Q.Q8_0] * len(names),
    "f32": lambda spec, names: [Q.F32] * len(names),
    # every compute type in turn, so one small file exercises them all
    "all-types": lambda spec, names: [_ALL_TYPES[i % len(_ALL_TYPES)] for i in range(len(names))],
}
_FILE_TYPES = {"q4_k_m": 15, "ud-q4_k_m": 15, "q8_0": 7, "f32": 0, "all-types": 15}


# ---- weight values -------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockScales:
    """Where a block keeps its fp16 scale(s) and the range they are drawn from."""

    d_offset: int
    d_range: tuple[float, float]
    min_offset: int | None = None  # second fp16 field (min / dmin), drawn as d · U(min_ratio)
    min_ratio: tuple[float, float] = (0.0, 0.0)


# Q4_K/Q5_K/Q8_0 use the anchors' ranges (dmin ≈ 7.5·d / 15.5·d centres the weights on 0). Q6_K's
# anchor range (6.2e-5–1.5e-4) with full-range int8 sub-block scales would give RMS ≈ 0.15, so its
# d is scaled down to reach the same RMS; the other types are set for RMS ≈ 0.04.
BLOCK_SCALES: dict[GGMLType, BlockScales] = {
    Q.Q4_0: BlockScales(0, (6e-3, 1.1e-2)),
    Q.Q4_1: BlockScales(0, (6e-3, 1.1e-2), 2, (-8.0, -7.0)),
    Q.Q5_0: BlockScales(0, (3e-3, 5.5e-3)),
    Q.Q5_1: BlockScales(0, (3e-3, 5.5e-3), 2, (-16.0, -15.0)),
    Q.Q8_0: BlockScales(0, (2e-4, 6e-4)),
    Q.Q4_K: BlockScales(0, (8e-5, 1.6e-4), 2, (7.0, 8.0)),
    Q.Q5_K: BlockScales(0, (6.2e-5, 1.2e-4), 2, (15.0, 16.0)),
    Q.Q6_K: BlockScales(208, (2e-5, 3.8e-5)),
    Q.IQ4_NL: BlockScales(0, (4.5e-4, 7.5e-4)),
    Q.IQ4_XS: BlockScales(0, (2.4e-5, 4e-5)),
}
WEIGHT_STD = 0.04  # float-typed weight matrices


def random_blocks(ggml_type: GGMLType, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """(n_blocks, block_bytes) uint8: random quants, scale fields drawn from BLOCK_SCALES."""
    block_bytes = BLOCK_GEOMETRY[ggml_type][1]
    n_bytes = n_blocks * block_bytes
    words = rng.bit_generator.random_raw(-(-n_bytes // 8))  # (⌈n_bytes/8⌉,) uint64
    blocks = words.view(np.uint8)[:n_bytes].reshape(n_blocks, block_bytes)  # (n_blocks, bytes)
    scales = BLOCK_SCALES[ggml_type]
    d = rng.uniform(*scales.d_range, n_blocks)  # (n_blocks,)
    _put_f16(blocks, scales.d_offset, d)
    if scales.min_offset is not None:
        _put_f16(blocks, scales.min_offset, d * rng.uniform(*scales.min_ratio, n_blocks))
    return blocks


def _put_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset:offset + 2] = values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _value_sampler(name: str, spec: SyntheticSpec) -> Callable[[np.random.Generator, int],
                                                                 np.ndarray]:
    """How the float values of a tensor are drawn (ARCHITECTURES.md §4.3 meanings)."""
    router_std = 1.0 / math.sqrt(spec.n_embd)  # logits ~ N(0, 1) for unit-RMS inputs
    if name.endswith(("_norm.weight", "nextn.enorm.weight", "nextn.hnorm.weight")):
        return lambda rng, n: rng.uniform(0.9, 1.1, n)
    if name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
        return lambda rng, n: rng.normal(0.0, router_std, n)
    if name.endswith("ssm_a"):  # −exp(A_log), HF init A ~ U(0, 16)
        return lambda rng, n: -rng.uniform(1.0, 16.0, n)
    if name.endswith("ssm_dt.bias"):  # inverse softplus of dt ~ logU(1e-3, 0.1), as HF inits it
        return lambda rng, n: np.log(np.expm1(np.exp(rng.uniform(np.log(1e-3), np.log(0.1), n))))
    if name.endswith(".bias") and "attn_" in name:  # qwen2's q/k/v biases
        return lambda rng, n: rng.normal(0.0, 0.1, n)
    if name.endswith("ssm_conv1d.weight"):
        return lambda rng, n: rng.uniform(-0.5, 0.5, n)
    return lambda rng, n: rng.normal(0.0, WEIGHT_STD, n)


def _float_bytes(values: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    if ggml_type == Q.BF16:  # round to nearest even on the upper 16 bits
        bits = values.astype("<f4").view("<u4").astype(np.uint64)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").view(np.uint8)
    dtype = {Q.F32: "<f4", Q.F16: "<f2"}[ggml_type]
    return values.astype(dtype).view(np.uint8)


def _tensor_chunks(spec: SyntheticSpec, t: TensorPlan, rng: np.random.Generator
                   ) -> Iterator[np.ndarray]:
    """The tensor's bytes, CHUNK_BYTES at a time (whole blocks per chunk)."""
    block_elems, block_bytes = BLOCK_GEOMETRY[t.ggml_type]
    n_blocks = t.n_elements // block_elems
    per_chunk = max(1, CHUNK_BYTES // block_bytes)
    sample = _value_sampler(t.name, spec)
    for start in range(0, n_blocks, per_chunk):
        n = min(per_chunk, n_blocks - start)
        if t.ggml_type in BLOCK_SCALES:
            yield random_blocks(t.ggml_type, n, rng).reshape(-1)
        else:
            yield _float_bytes(sample(rng, n * block_elems), t.ggml_type)


def _tensor_rng(seed: int, index: int) -> np.random.Generator:
    return np.random.Generator(np.random.SFC64([seed, index]))


def tensor_data(preset: str | SyntheticSpec, name: str, seed: int = 0) -> np.ndarray:
    """One tensor exactly as `write_synthetic` writes it, in numpy order (like GGUFFile.raw):
    F32/F16 with their dtype, quantized and BF16 as uint8 rows of bytes."""
    spec = resolve_preset(preset)
    plan = tensor_plan(spec)
    index = next((i for i, t in enumerate(plan) if t.name == name), None)
    if index is None:
        raise ValueError(f"{spec.name} has no tensor {name!r}")
    t = plan[index]
    raw = np.concatenate(list(_tensor_chunks(spec, t, _tensor_rng(seed, index))))  # (n_bytes,)
    rows = tuple(reversed(t.shape[1:]))
    if t.ggml_type in (Q.F32, Q.F16):
        return raw.view("<f4" if t.ggml_type == Q.F32 else "<f2").reshape(rows + (t.shape[0],))
    return raw.reshape(rows + (-1,))


# ---- tokenizer (GGUF.md §5) ----------------------------------------------------------------------
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4
_PRETOKENIZE = re.compile(r"'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d| ?[^\s\w]+|\s+(?!\S)|\s+")
_ENGLISH = ("The quick brown fox jumps over the lazy dog. A tokenizer splits text into pieces; "
            "the model reads numbers like 12345 and words in many languages: naïve café, "
            "def forward(self, x):\n    return self.norm(x) + 1\n")


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte → printable character map, in its id order (printable bytes first)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(rest)}


@functools.cache
def bpe_vocab(n_merges: int = N_MERGES) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens, merges) of a byte-level BPE trained on a small built-in corpus: 256 byte tokens
    then one token per merge (deterministic: ties broken by the pair's text)."""
    char_of = _byte_chars()
    corpus = _PRETOKENIZE.findall(QWEN3_CHAT_TEMPLATE + _ENGLISH)
    words = Counter(tuple(char_of[b] for b in piece.encode("utf-8")) for piece in corpus)
    tokens, merges = list(char_of.values()), []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(f"{best[0]} {best[1]}")
        if best[0] + best[1] not in tokens:
            tokens.append(best[0] + best[1])
        words = Counter({(_merge_pair(w, best) if best[0] in w else w): c
                         for w, c in words.items()})
    return tuple(tokens), tuple(merges)


def _merge_pair(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def vocabulary(spec: SyntheticSpec) -> tuple[list[str], list[int], tuple[str, ...]]:
    """(tokens, token types, merges): BPE tokens, then made-up words to fill n_vocab, with the
    Qwen specials at their base.

    NOTE: a random model samples every id alike, so no filler may print nothing (as a real file's
    [PADn] entries do): streamed text then arrives token by token, like a real model's."""
    bpe_tokens, merges = bpe_vocab(min(N_MERGES, spec.special_token_base - 256))
    base, num_special = spec.special_token_base, len(SPECIAL_TOKENS)
    normal = [*bpe_tokens, *made_up_words(spec.n_vocab - num_special - len(bpe_tokens),
                                          set(bpe_tokens))]
    tokens = [*normal[:base], *SPECIAL_TOKENS, *normal[base:]]
    types = [TOKEN_NORMAL] * spec.n_vocab
    types[base:base + num_special] = [TOKEN_CONTROL if t.startswith("<|") else TOKEN_USER_DEFINED
                                      for t in SPECIAL_TOKENS]
    return tokens, types, merges


def made_up_words(n: int, taken: Collection[str]) -> list[str]:
    """n distinct pronounceable words with a leading space (" ka", " kabe", …), in byte-level
    form ("Ġka"), shortest first and none in `taken` (75 syllables: 3 make 427k words)."""
    syllables = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]
    words = ("Ġ" + "".join(parts) for length in itertools.count(1)
             for parts in itertools.product(syllables, repeat=length))
    return list(itertools.islice((w for w in words if w not in taken), n))


# ---- metadata and the GGUF header (GGUF.md §1) ---------------------------------------------------
_U32, _I32, _F32, _BOOL, _STR, _ARR = 4, 5, 6, 7, 8, 9  # GGUFValueType ids
_SCALAR_FORMATS = {_U32: "<I", _I32: "<i", _F32: "<f", _BOOL: "<?"}
_ARRAY_DTYPES = {_I32: "<i4", _F32: "<f4", _BOOL: "<?", _U32: "<u4"}
Metadata = list[tuple[str, int, Any, int]]  # (key, value type, value, array element type)


def metadata(spec: SyntheticSpec) -> Metadata:
    a = spec.arch
    kv: Metadata = [
        ("general.architecture", _STR, a, 0), ("general.name", _STR, spec.name, 0),
        ("general.file_type", _U32, _FILE_TYPES[spec.recipe], 0),
        ("general.quantization_version", _U32, 2, 0),
        (f"{a}.block_count", _U32, spec.n_layer + spec.mtp_layers, 0),
        (f"{a}.context_length", _U32, spec.context_length, 0),
        (f"{a}.embedding_length", _U32, spec.n_embd, 0),
        (f"{a}.attention.head_count", _U32, spec.n_head, 0),
        (f"{a}.attention.head_count_kv", _U32, spec.n_head_kv, 0),
        (f"{a}.attention.key_length", _U32, spec.head_dim, 0),
        (f"{a}.attention.value_length", _U32, spec.head_dim, 0),
        (f"{a}.rope.freq_base", _F32, spec.rope_base, 0),
        (f"{a}.attention.layer_norm_rms_epsilon", _F32, spec.rms_eps, 0),
    ]
    if spec.n_ff:
        kv.append((f"{a}.feed_forward_length", _U32, spec.n_ff, 0))
    if spec.mtp_layers:
        kv.append((f"{a}.nextn_predict_layers", _U32, spec.mtp_layers, 0))
    return kv + _moe_metadata(spec) + _hybrid_metadata(spec) + _tokenizer_metadata(spec)


def _moe_metadata(spec: SyntheticSpec) -> Metadata:
    if not spec.is_moe:
        return []
    a = spec.arch
    kv: Metadata = [(f"{a}.expert_count", _U32, spec.n_expert, 0),
                    (f"{a}.expert_used_count", _U32, spec.n_expert_used, 0),
                    (f"{a}.expert_feed_forward_length", _U32, spec.n_ff_exp, 0)]
    if a in SHARED_EXPERT_ARCHITECTURES:
        kv.append((f"{a}.expert_shared_feed_forward_length", _U32, spec.n_ff_shexp, 0))
    return kv


def _hybrid_metadata(spec: SyntheticSpec) -> Metadata:
    if not spec.is_hybrid:
        return []
    a = spec.arch
    recurrent = [spec.is_recurrent(i) for i in range(spec.n_layer)]
    kv: Metadata = [
        (f"{a}.rope.dimension_count", _U32, spec.n_rot or spec.head_dim, 0),
        (f"{a}.ssm.conv_kernel", _U32, spec.ssm_conv_kernel, 0),
        (f"{a}.ssm.state_size", _U32, spec.ssm_d_state, 0),
        (f"{a}.ssm.group_count", _U32, spec.ssm_n_group, 0),
        (f"{a}.ssm.time_step_rank", _U32, spec.ssm_n_v_heads, 0),
        (f"{a}.ssm.inner_size", _U32, spec.ssm_n_v_heads * spec.ssm_d_state, 0),
        (f"{a}.full_attention_interval", _U32, spec.full_attention_interval, 0),
        (f"{a}.attention.recurrent_layers", _ARR, recurrent, _BOOL),
    ]
    if spec.rope_sections:
        kv.append((f"{a}.rope.dimension_sections", _ARR, list(spec.rope_sections), _I32))
    return kv


def _tokenizer_metadata(spec: SyntheticSpec) -> Metadata:
    tokens, types, merges = vocabulary(spec)
    base = spec.special_token_base
    return [
        ("tokenizer.ggml.model", _STR, "gpt2", 0),
        ("tokenizer.ggml.pre", _STR, spec.tokenizer_pre, 0),
        ("tokenizer.ggml.tokens", _ARR, tokens, _STR),
        ("tokenizer.ggml.token_type", _ARR, types, _I32),
        ("tokenizer.ggml.merges", _ARR, list(merges), _STR),
        ("tokenizer.ggml.bos_token_id", _U32, base + SPECIAL_TOKENS.index("<|endoftext|>"), 0),
        ("tokenizer.ggml.eos_token_id", _U32, base + SPECIAL_TOKENS.index("<|im_end|>"), 0),
        ("tokenizer.ggml.padding_token_id", _U32, base + SPECIAL_TOKENS.index("<|endoftext|>"), 0),
        ("tokenizer.ggml.add_bos_token", _BOOL, False, 0),
        ("tokenizer.chat_template", _STR, QWEN3_CHAT_TEMPLATE, 0),
    ]


def _pack_string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _pack_value(vtype: int, value: Any, element_type: int) -> bytes:
    if vtype == _STR:
        return _pack_string(value)
    if vtype != _ARR:
        return struct.pack(_SCALAR_FORMATS[vtype], value)
    head = struct.pack("<IQ", element_type, len(value))
    if element_type == _STR:
        return head + b"".join(map(_pack_string, value))
    return head + np.asarray(value, dtype=_ARRAY_DTYPES[element_type]).tobytes()


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def header_bytes(spec: SyntheticSpec, plan: list[TensorPlan]) -> bytes:
    """Magic, metadata and tensor table, zero-padded to where the tensor data starts."""
    kv = metadata(spec)
    parts = [b"GGUF", struct.pack("<IQQ", 3, len(plan), len(kv))]
    parts += [_pack_string(key) + struct.pack("<I", vtype) + _pack_value(vtype, value, element)
              for key, vtype, value, element in kv]
    offset = 0
    for t in plan:
        parts.append(_pack_string(t.name) + struct.pack(f"<I{len(t.shape)}QIQ", len(t.shape),
                                                         *t.shape, t.ggml_type, offset))
        offset += _align(t.n_bytes)
    header = b"".join(parts)
    return header + bytes(_align(len(header)) - len(header))


# ---- public entry points -------------------------------------------------------------------------
def preset_summary(preset: str | SyntheticSpec) -> dict[str, Any]:
    """Tensor count, type histogram, parameters and sizes of a preset, without writing it."""
    spec = resolve_preset(preset)
    plan = tensor_plan(spec)
    tensor_total = sum(t.n_bytes for t in plan)
    return {
        "name": spec.name, "arch": spec.arch, "n_tensors": len(plan),
        "types": dict(Counter(t.ggml_type.name for t in plan)),
        "n_params": sum(t.n_elements for t in plan), "tensor_bytes": tensor_total,
        "file_bytes": len(header_bytes(spec, plan)) + sum(_align(t.n_bytes) for t in plan),
    }


def write_synthetic(path: str | Path, preset: str | SyntheticSpec, seed: int = 0,
                    progress: Progress | None = None) -> Path:
    """Write the preset's GGUF to `path` (via `path.partial`, renamed when complete)."""
    spec = resolve_preset(preset)
    plan = tensor_plan(spec)
    header = header_bytes(spec, plan)
    total = len(header) + sum(_align(t.n_bytes) for t in plan)
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(header)
        done = len(header)
        for index, t in enumerate(plan):
            for chunk in _tensor_chunks(spec, t, _tensor_rng(seed, index)):
                f.write(memoryview(chunk))
                done += chunk.nbytes
                if progress is not None:
                    progress(done, total)
            f.write(bytes(_align(t.n_bytes) - t.n_bytes))
            done = f.tell()
    partial.replace(path)
    return path


# Qwen3's chat template (llama.cpp models/templates/Qwen-Qwen3-0.6B.jinja without the final newline)
QWEN3_CHAT_TEMPLATE = r'''{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}'''
