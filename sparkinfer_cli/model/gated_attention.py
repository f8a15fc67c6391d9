"""Gated full attention of the hybrids (qwen35, qwen35moe, qwen3next; llama.cpp's build_layer_attn).

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
from sparkinfer_cli.model.layers import Attention, Forward, Linear
from sparkinfer_cli.model.weights import QTensor, Weights


class GatedAttention(Attention):
    def __init__(self, w: Weights, cfg: ModelConfig, layer: int):
        super().__init__(w, cfg, layer, qkv_bias=False, qk_norm=True)

    def build_query(self, w: Weights, cfg: ModelConfig, prefix: str,
                    bias: QTensor | None) -> Linear:
        """Split attn_q's interleaved rows once at load: the query part, and the output gate."""
        H, D = cfg.n_head, cfg.head_dim
        attn_q = w.get(prefix + "attn_q.weight", (cfg.n_embd, 2 * H * D))
        head_rows = np.arange(H)[:, None] * 2 * D + np.arange(D)  # (H, D) query rows
        gate_rows = (head_rows + D).ravel()
        self.attn_q_gate = Linear(attn_q.select_rows(gate_rows, prefix + "attn_q.gate"))
        return Linear(attn_q.select_rows(head_rows.ravel(), prefix + "attn_q.weight"))

    def __call__(self, x: np.ndarray, fwd: Forward) -> np.ndarray:
        q, k, v = self.project_qkv(x, fwd)
        gate = ops.sigmoid(self.attn_q_gate(x))  # (N, H·D)
        return self.attn_output(self.attend(q, k, v, fwd) * gate)
