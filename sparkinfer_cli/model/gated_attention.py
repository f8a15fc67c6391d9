"""Gated full attention of the hybrids (qwen35, qwen35moe, qwen3next; ARCHITECTURES.md §4.4.1).

Like qwen3 attention (per-head q/k RMSNorm, NEOX RoPE on the first n_rot dims of each head), except
that attn_q also yields an output gate, and the attention output is multiplied by sigmoid(gate)
before attn_output. attn_q's rows, per head h:

    [ h·2D, h·2D + D )      query head h
    [ h·2D + D, (h+1)·2D )  gate head h
"""

from __future__ import annotations

import numpy as np

from sparkinfer_cli.kernels.cpu import ops
from sparkinfer_cli.model.config import ModelConfig
from sparkinfer_cli.model.gated_delta_net import select_rows
from sparkinfer_cli.model.layers import Attention, Forward, Linear, RMSNorm
from sparkinfer_cli.model.weights import Weights


class GatedAttention(Attention):
    def __init__(self, w: Weights, cfg: ModelConfig, layer: int):
        p, E, H, D = f"blk.{layer}.", cfg.n_embd, cfg.n_head, cfg.head_dim
        kv_dim = cfg.n_head_kv * D
        attn_q = w.get(p + "attn_q.weight", (E, 2 * H * D))
        # split once at load so that Attention.project_qkv sees a plain (E, H·D) query projection
        head_rows = np.arange(H)[:, None] * 2 * D + np.arange(D)  # (H, D) query rows
        self.attn_q = Linear(select_rows(attn_q, head_rows.ravel(), p + "attn_q.weight"))
        self.attn_q_gate = Linear(select_rows(attn_q, (head_rows + D).ravel(), p + "attn_q.gate"))
        self.attn_k = Linear(w.get(p + "attn_k.weight", (E, kv_dim)))
        self.attn_v = Linear(w.get(p + "attn_v.weight", (E, kv_dim)))
        self.attn_output = Linear(w.get(p + "attn_output.weight", (H * D, E)))
        self.attn_q_norm = RMSNorm(w.get(p + "attn_q_norm.weight", (D,)), cfg.rms_eps)
        self.attn_k_norm = RMSNorm(w.get(p + "attn_k_norm.weight", (D,)), cfg.rms_eps)
        self.layer, self.cfg = layer, cfg

    def __call__(self, x: np.ndarray, fwd: Forward) -> np.ndarray:
        q, k, v = self.project_qkv(x, fwd)
        gate = ops.sigmoid(self.attn_q_gate(x))  # (N, H·D)
        return self.attn_output(self.attend(q, k, v, fwd) * gate)
