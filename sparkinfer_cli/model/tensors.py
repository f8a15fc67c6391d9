"""Which GGUF tensors each block of each architecture reads: the files' naming variants resolved
once, into records that both backends build their layers from.

    tensors = resolve_tensors(gguf, config)   # ModelTensors: views of the file (rows split out
                                              # of a fused tensor are host copies)

The CPU model (base.py) wraps the records in its compute layers; the CUDA backend uploads them
(backend/cuda), so loading on the GPU never builds the CPU model. Every tensor of the file must
be taken by some record (Weights.check_all_used), except the NextN/MTP blocks past the trunk.

The layouts (llama.cpp's src/models/*.cpp):
- llama: RMSNorm → attention (RoPE on adjacent pairs: the converter permuted q/k) → SwiGLU.
- qwen2 (Qwen2 / Qwen2.5): llama with q/k/v biases and NEOX RoPE.
- qwen3: attention with per-head q/k RMSNorm before NEOX RoPE, head_dim from key_length.
- qwen3moe (Qwen3-30B-A3B): qwen3's attention with a routed MoE FFN in every layer, no shared
  expert.
- qwen35 (Qwen3.5 / Qwen3.6 dense): hybrid. Layer i is a Gated DeltaNet layer or a gated
  full-attention layer (config.recurrent_layers), followed by post_attention_norm and the FFN.
  The converter reorders V heads to tiled order, so v-head h reads q/k head h mod H_k. IMROPE
  with text positions (p, p, p, 0) equals NEOX RoPE on the first n_rot dims.
- qwen35moe (Qwen3.5 / Qwen3.6-35B-A3B): qwen35's layers with a routed MoE FFN and a
  sigmoid-gated shared expert in every layer.
- qwen3next (Qwen3-Next-80B-A3B, Qwen3-Coder-Next): qwen35moe's layers, but the GGUF keeps HF's
  grouped V-head order (v-head h reads q/k head h // (H_v / H_k)); its GDN layers have a fused
  ssm_ba and, in older files, a fused ssm_in, both split here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from sparkinfer_cli.gguf.reader import GGUFError, GGUFFile
from sparkinfer_cli.model.config import ModelConfig
from sparkinfer_cli.model.weights import QTensor, Weights


@dataclass(frozen=True)
class Layout:
    """What distinguishes the architectures' blocks."""
    qkv_bias: bool = False
    qk_norm: bool = False
    hybrid: bool = False  # Gated DeltaNet / gated attention layers, post_attention_norm
    moe: bool = False
    shared_expert: bool = False
    gdn_head_map: str = "mod"  # v-head h → q/k head h mod H_k ("div": h // (H_v / H_k))


_HYBRID_MOE = Layout(qk_norm=True, hybrid=True, moe=True, shared_expert=True)
LAYOUTS = {
    "llama": Layout(),
    "qwen2": Layout(qkv_bias=True),
    "qwen3": Layout(qk_norm=True),
    "qwen3moe": Layout(qk_norm=True, moe=True),
    "qwen35": Layout(qk_norm=True, hybrid=True),
    "qwen35moe": _HYBRID_MOE,
    "qwen3next": replace(_HYBRID_MOE, gdn_head_map="div"),
}


@dataclass(frozen=True)
class AttentionTensors:
    q: QTensor
    k: QTensor
    v: QTensor
    output: QTensor
    q_bias: QTensor | None = None
    k_bias: QTensor | None = None
    v_bias: QTensor | None = None
    q_norm: QTensor | None = None  # per-head RMSNorm weights (head_dim,)
    k_norm: QTensor | None = None
    q_gate: QTensor | None = None  # gated attention: the output gate's rows of attn_q


@dataclass(frozen=True)
class DeltaNetTensors:
    qkv: QTensor  # attn_qkv (E, conv_dim): [q | k | v]
    z: QTensor  # attn_gate (E, value_dim)
    beta: QTensor  # ssm_beta (E, H_v)
    alpha: QTensor  # ssm_alpha (E, H_v)
    conv1d: QTensor  # (K, conv_dim)
    dt: QTensor  # ssm_dt.bias (H_v,)
    a: QTensor  # ssm_a (H_v,): −exp(A_log)
    norm: QTensor  # ssm_norm (d_v,)
    out: QTensor  # ssm_out (value_dim, E)
    head_map: str  # Layout.gdn_head_map


@dataclass(frozen=True)
class SwiGLUTensors:
    gate: QTensor
    up: QTensor
    down: QTensor


@dataclass(frozen=True)
class SharedExpertTensors:
    ffn: SwiGLUTensors
    gate: QTensor  # ffn_gate_inp_shexp: [E] or [E, 1], the shared expert's gate logit


@dataclass(frozen=True)
class MoETensors:
    router: QTensor  # ffn_gate_inp (E, n_expert)
    gate_exps: QTensor  # (E, ff, n_expert)
    up_exps: QTensor
    down_exps: QTensor  # (ff, E, n_expert)
    shared: SharedExpertTensors | None = None


@dataclass(frozen=True)
class LayerTensors:
    attn_norm: QTensor
    mixer: AttentionTensors | DeltaNetTensors
    ffn_norm: QTensor
    ffn: SwiGLUTensors | MoETensors


@dataclass(frozen=True)
class ModelTensors:
    token_embd: QTensor
    layers: tuple[LayerTensors, ...]
    output_norm: QTensor
    output: QTensor  # token_embd when the embeddings are tied
    path: Path  # the file, which QTensor.offset points into


@dataclass(frozen=True)
class MtpTensors:
    """A NextN / multi-token-prediction block (llama.cpp's qwen35 layout): from the trunk's
    normed hidden state at position p and the embedding of token p + 1, a gated full-attention
    layer with the trunk's kind of FFN predicts token p + 2 through the trunk's LM head."""
    layer: LayerTensors
    eh_proj: QTensor  # (2E, E): [enorm(embedding) | hnorm(hidden)] → E
    enorm: QTensor
    hnorm: QTensor
    head_norm: QTensor  # shared_head_norm, else the trunk's output_norm


def resolve_tensors(gguf: GGUFFile, config: ModelConfig) -> ModelTensors:
    """Every tensor the architecture reads, checked for shape and type; GGUFError for a missing,
    misshaped or unexpected one."""
    layout = LAYOUTS[config.arch]
    w = Weights(gguf, config.n_layer)
    E, V = config.n_embd, config.n_vocab
    token_embd = w.get("token_embd.weight", (E, V))
    layers = tuple(_layer(w, config, layout, i) for i in range(config.n_layer))
    output_norm = w.get("output_norm.weight", (E,))
    output = token_embd if config.tied_embeddings else w.get("output.weight", (E, V))
    w.check_all_used()
    return ModelTensors(token_embd, layers, output_norm, output, gguf.path)


def resolve_mtp_tensors(gguf: GGUFFile, config: ModelConfig) -> MtpTensors | None:
    """The file's first MTP block (None: it has none); GGUFError for a missing or misshaped
    tensor of it."""
    if not config.mtp_layers:
        return None
    if config.arch not in ("qwen35", "qwen35moe"):
        raise GGUFError(f"{gguf.path}: MTP heads of {config.arch} files are not supported")
    w, i, E = Weights(gguf, config.n_layer + 1), config.n_layer, config.n_embd
    p = f"blk.{i}.nextn."
    return MtpTensors(_layer(w, config, LAYOUTS[config.arch], i, mtp=True),
                      w.get(p + "eh_proj.weight", (2 * E, E)), w.get(p + "enorm.weight", (E,)),
                      w.get(p + "hnorm.weight", (E,)),
                      w.optional(p + "shared_head_norm.weight", (E,)) or
                      w.get("output_norm.weight", (E,)))


def _layer(w: Weights, cfg: ModelConfig, layout: Layout, i: int,
           mtp: bool = False) -> LayerTensors:
    """Block i (an MTP block's attention is full attention whatever the trunk's pattern)."""
    p, E = f"blk.{i}.", cfg.n_embd
    mixer: AttentionTensors | DeltaNetTensors
    if layout.hybrid and not mtp and cfg.is_recurrent(i):
        mixer = _delta_net(w, cfg, p, layout.gdn_head_map)
    else:
        mixer = _attention(w, cfg, p, layout)
    ffn_norm = "post_attention_norm" if layout.hybrid else "ffn_norm"
    ffn = _moe(w, cfg, p, layout.shared_expert) if layout.moe else \
        _swiglu(w, p + "ffn_", "", E, cfg.n_ff)
    return LayerTensors(w.get(p + "attn_norm.weight", (E,)), mixer,
                        w.get(f"{p}{ffn_norm}.weight", (E,)), ffn)


def _attention(w: Weights, cfg: ModelConfig, p: str, layout: Layout) -> AttentionTensors:
    E, hd = cfg.n_embd, cfg.head_dim
    q_dim, kv_dim = cfg.n_head * hd, cfg.n_head_kv * hd

    def bias(name: str, dim: int) -> QTensor | None:
        return w.get(p + name + ".bias", (dim,)) if layout.qkv_bias else None

    def head_norm(name: str) -> QTensor | None:
        return w.get(p + name + ".weight", (hd,)) if layout.qk_norm else None

    if layout.hybrid:
        q, q_gate = _query_and_gate(w, cfg, p)
    else:
        q, q_gate = w.get(p + "attn_q.weight", (E, q_dim)), None
    return AttentionTensors(
        q, w.get(p + "attn_k.weight", (E, kv_dim)), w.get(p + "attn_v.weight", (E, kv_dim)),
        w.get(p + "attn_output.weight", (q_dim, E)), bias("attn_q", q_dim),
        bias("attn_k", kv_dim), bias("attn_v", kv_dim), head_norm("attn_q_norm"),
        head_norm("attn_k_norm"), q_gate)


def _query_and_gate(w: Weights, cfg: ModelConfig, p: str) -> tuple[QTensor, QTensor]:
    """Gated attention's attn_q holds, per head h, rows [h·2D, h·2D + D) of query head h, then
    D rows of its output gate: split once, at load."""
    H, D = cfg.n_head, cfg.head_dim
    attn_q = w.get(p + "attn_q.weight", (cfg.n_embd, 2 * H * D))
    head_rows = np.arange(H)[:, None] * 2 * D + np.arange(D)  # (H, D) query rows
    return (attn_q.select_rows(head_rows.ravel(), p + "attn_q.weight"),
            attn_q.select_rows((head_rows + D).ravel(), p + "attn_q.gate"))


def _delta_net(w: Weights, cfg: ModelConfig, p: str, head_map: str) -> DeltaNetTensors:
    H_v, d_v = cfg.ssm_n_v_heads, cfg.ssm_inner_size // cfg.ssm_n_v_heads
    qkv, z = _input_projections(w, p, cfg)
    beta, alpha = _beta_alpha_projections(w, p, cfg)
    return DeltaNetTensors(
        qkv, z, beta, alpha,
        w.get(p + "ssm_conv1d.weight", (cfg.ssm_conv_kernel, cfg.ssm_conv_dim)),
        w.get(p + "ssm_dt.bias", (H_v,)), w.get(p + "ssm_a", (H_v,)),
        w.get(p + "ssm_norm.weight", (d_v,)),
        w.get(p + "ssm_out.weight", (cfg.ssm_inner_size, cfg.n_embd)), head_map)


def _input_projections(w: Weights, p: str, cfg: ModelConfig) -> tuple[QTensor, QTensor]:
    """attn_qkv (E, conv_dim) and attn_gate (E, value_dim), or both cut from a legacy ssm_in."""
    E, value_dim = cfg.n_embd, cfg.ssm_inner_size
    if not w.has(p + "ssm_in.weight"):
        return (w.get(p + "attn_qkv.weight", (E, cfg.ssm_conv_dim)),
                w.get(p + "attn_gate.weight", (E, value_dim)))
    H_k, d = cfg.ssm_n_group, cfg.ssm_d_state
    r_dv = value_dim // H_k  # v (and z) rows per k-head group
    ssm_in = w.get(p + "ssm_in.weight", (E, cfg.ssm_conv_dim + value_dim))
    # ssm_in rows, per k-head group g: [q_g (d) | k_g (d) | v_g (r·d_v) | z_g (r·d_v)]
    q, k, v, z = _group_rows(H_k, (d, d, r_dv, r_dv))
    return (ssm_in.select_rows(np.concatenate([q, k, v]), p + "attn_qkv.weight"),
            ssm_in.select_rows(z, p + "attn_gate.weight"))


def _beta_alpha_projections(w: Weights, p: str, cfg: ModelConfig) -> tuple[QTensor, QTensor]:
    """ssm_beta and ssm_alpha (E, H_v), or both cut from qwen3next's fused ssm_ba."""
    E, H_v, H_k = cfg.n_embd, cfg.ssm_n_v_heads, cfg.ssm_n_group
    if not w.has(p + "ssm_ba.weight"):
        return w.get(p + "ssm_beta.weight", (E, H_v)), w.get(p + "ssm_alpha.weight", (E, H_v))
    ssm_ba = w.get(p + "ssm_ba.weight", (E, 2 * H_v))
    # ssm_ba rows, per k-head group g: [b_g (r) | a_g (r)]; v-head g·r + i is entry i of group g
    b, a = _group_rows(H_k, (H_v // H_k, H_v // H_k))
    return (ssm_ba.select_rows(b, p + "ssm_beta.weight"),
            ssm_ba.select_rows(a, p + "ssm_alpha.weight"))


def _group_rows(n_groups: int, widths: tuple[int, ...]) -> list[np.ndarray]:
    """Row ids of each field of a per-group interleaved layout, grouped by field then group."""
    starts = np.concatenate([[0], np.cumsum(widths)])  # (n_fields + 1,)
    group_base = np.arange(n_groups)[:, None] * starts[-1]  # (n_groups, 1)
    return [(group_base + lo + np.arange(hi - lo)).ravel() for lo, hi in zip(starts, starts[1:])]


def _swiglu(w: Weights, prefix: str, suffix: str, n_embd: int, n_ff: int) -> SwiGLUTensors:
    """Tensors `{prefix}gate{suffix}.weight`, `…up…`, `…down…`."""
    return SwiGLUTensors(w.get(f"{prefix}gate{suffix}.weight", (n_embd, n_ff)),
                         w.get(f"{prefix}up{suffix}.weight", (n_embd, n_ff)),
                         w.get(f"{prefix}down{suffix}.weight", (n_ff, n_embd)))


def _moe(w: Weights, cfg: ModelConfig, p: str, shared_expert: bool) -> MoETensors:
    E, n = cfg.n_embd, cfg.n_expert
    ff = cfg.n_ff_exp or cfg.n_ff // cfg.n_expert_used  # llama.cpp's fallback width
    gate, up = _gate_and_up_experts(w, p + "ffn_", E, ff, n)
    shared = None
    if shared_expert:  # the shared expert's width falls back to n_ff, as llama.cpp's does
        shared = SharedExpertTensors(
            _swiglu(w, p + "ffn_", "_shexp", E, cfg.n_ff_shexp or cfg.n_ff),
            _shared_gate(w, p + "ffn_gate_inp_shexp.weight", E))
    return MoETensors(w.get(p + "ffn_gate_inp.weight", (E, n)), gate, up,
                      w.get(p + "ffn_down_exps.weight", (ff, E, n)), shared)


def _gate_and_up_experts(w: Weights, p: str, E: int, ff: int, n: int) -> tuple[QTensor, QTensor]:
    """ffn_gate_exps and ffn_up_exps, or both as views of a fused ffn_gate_up_exps
    (--fuse-gate-up-exps: per expert, the ff gate rows, then the ff up rows)."""
    fused = w.optional(p + "gate_up_exps.weight", (E, 2 * ff, n))
    if fused is None:
        return w.get(p + "gate_exps.weight", (E, ff, n)), w.get(p + "up_exps.weight", (E, ff, n))
    return (QTensor(p + "gate_exps.weight", fused.ggml_type, (E, ff, n), fused.raw[:, :ff]),
            QTensor(p + "up_exps.weight", fused.ggml_type, (E, ff, n), fused.raw[:, ff:]))


def _shared_gate(w: Weights, name: str, n_embd: int) -> QTensor:
    """ffn_gate_inp_shexp, stored as [E] or [E, 1]."""
    t = w.get(name)
    if t.shape not in ((n_embd,), (n_embd, 1)):
        raise GGUFError(f"tensor {name!r} has shape {list(t.shape)}, expected [{n_embd}] "
                        f"or [{n_embd}, 1]")
    return t
