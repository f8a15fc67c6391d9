"""Mixture-of-experts FFN of qwen3moe / qwen35moe / qwen3next (llama.cpp's build_moe_ffn).

    p = softmax(ffn_gate_inp · y) over all experts;  top-k;  w = p_sel / max(Σ p_sel, 6.1e-5)
    moe = Σ_i w_i · down_e(silu(gate_e(y)) ⊙ up_e(y))           e = sel_i, only the k selected
    out = moe + sigmoid(ffn_gate_inp_shexp · y) · shexp(y)       (qwen35moe / qwen3next)

Expert tensors are 3-D (GGUF ne [in, out, n_expert], numpy (n_expert, out, in)); a token touches
only the rows of its k experts.
"""

from __future__ import annotations

import numpy as np

from sparkinfer_cli.kernels.cpu import ops
from sparkinfer_cli.kernels.cpu.moe_routing import group_tokens_by_expert, route
from sparkinfer_cli.kernels.cpu.quant import matmul_row_invariant
from sparkinfer_cli.kernels.cpu.swiglu import swiglu
from sparkinfer_cli.model.config import ModelConfig
from sparkinfer_cli.model.layers import Linear, SwiGLU
from sparkinfer_cli.model.tensors import MoETensors, SharedExpertTensors
from sparkinfer_cli.model.weights import QTensor


class ExpertLinear:
    """A stack of per-expert weights; `(e, x)` → x · W[e]ᵀ. x: (T, in) → (T, out); an expert's T
    varies with what else is in the pass, so each row is computed the same way whatever T."""

    def __init__(self, weight: QTensor):
        self.weight = weight

    def __call__(self, expert: int, x: np.ndarray) -> np.ndarray:
        w = self.weight
        return matmul_row_invariant(w.raw[expert], w.ggml_type, w.ne0, x)


class SharedExpert:
    """sigmoid(ffn_gate_inp_shexp · y) · SwiGLU_shexp(y): one scalar gate per token."""

    def __init__(self, t: SharedExpertTensors):
        self.shexp = SwiGLU(t.ffn)
        self.ffn_gate_inp_shexp = np.ascontiguousarray(t.gate.as_f32().reshape(-1))  # (n_embd,)

    def __call__(self, y: np.ndarray) -> np.ndarray:
        # each token's dot summed along its own row (a GEMV over T rows may sum them by T)
        gate = ops.sigmoid((y * self.ffn_gate_inp_shexp).sum(axis=-1))  # (T,)
        return self.shexp(y) * gate[:, None]


class MoE:
    """Routed SwiGLU experts, plus a gated shared expert (qwen35moe / qwen3next)."""

    def __init__(self, t: MoETensors, cfg: ModelConfig):
        self.n_expert, self.n_expert_used = cfg.n_expert, cfg.n_expert_used
        self.ffn_gate_inp = Linear(t.router)
        self.ffn_gate_exps, self.ffn_up_exps = ExpertLinear(t.gate_exps), ExpertLinear(t.up_exps)
        self.ffn_down_exps = ExpertLinear(t.down_exps)
        self.shared = SharedExpert(t.shared) if t.shared is not None else None

    def __call__(self, y: np.ndarray) -> np.ndarray:
        out = self.routed(y)  # (T, n_embd)
        return out + self.shared(y) if self.shared is not None else out

    def routed(self, y: np.ndarray) -> np.ndarray:
        T, k = len(y), self.n_expert_used
        ids, weights = route(self.ffn_gate_inp(y), k)  # (T, k) each
        order, rows, offsets = group_tokens_by_expert(ids, self.n_expert)
        per_slot = np.empty((T * k, y.shape[1]), dtype=np.float32)  # (T·k, n_embd)
        for e in np.flatnonzero(np.diff(offsets)):
            lo, hi = offsets[e], offsets[e + 1]
            per_slot[order[lo:hi]] = self.expert(int(e), y[rows[lo:hi]])
        per_slot *= weights.reshape(-1, 1)
        # NOTE: summed over slots in top-k order, as llama.cpp adds its expert views
        return per_slot.reshape(T, k, -1).sum(axis=1)

    def expert(self, e: int, x: np.ndarray) -> np.ndarray:
        hidden = swiglu(self.ffn_gate_exps(e, x), self.ffn_up_exps(e, x))  # (n, ff)
        return self.ffn_down_exps(e, hidden)  # (n, n_embd)
