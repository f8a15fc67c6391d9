"""Gated full attention of the hybrids (qwen35, qwen35moe, qwen3next; llama.cpp's build_layer_attn).

Like qwen3 attention (per-head q/k RMSNorm, NEOX RoPE on the first n_rot dims of each head), except
that attn_q also yields an output gate, and the attention output is multiplied by sigmoid(gate)
before attn_output. attn_q's rows, per head h, are D rows of query head h then D rows of gate
head h (split at load: model/tensors.py).
"""

from __future__ import annotations

import numpy as np

from sparkinfer_cli.kernels.cpu import ops
from sparkinfer_cli.model.config import ModelConfig
from sparkinfer_cli.model.layers import Attention, Forward, Linear
from sparkinfer_cli.model.tensors import AttentionTensors
from sparkinfer_cli.model.weights import QTensor


class GatedAttention(Attention):
    def __init__(self, t: AttentionTensors, q_gate: QTensor, cfg: ModelConfig, layer: int):
        super().__init__(t, cfg, layer)
        self.attn_q_gate = Linear(q_gate)

    def __call__(self, x: np.ndarray, fwd: Forward) -> np.ndarray:
        q, k, v = self.project_qkv(x, fwd)
        gate = ops.sigmoid(self.attn_q_gate(x))  # (N, H·D)
        return self.attn_output(self.attend(q, k, v, fwd) * gate)
