"""Mixture-of-experts FFN of qwen3moe / qwen35moe / qwen3next (llama.cpp's build_moe_ffn).

    p = softmax(ffn_gate_inp · y) over all experts;  top-k;  w = p_sel / max(Σ p_sel, 6.1e-5)
    moe = Σ_i w_i · down_e(silu(gate_e(y)) ⊙ up_e(y))           e = sel_i, only the k selected
    out = moe + sigmoid(ffn_gate_inp_shexp · y) · shexp(y)       (qwen35moe / qwen3next)

Expert tensors are 3-D (GGUF ne [in, out, n_expert], numpy (n_expert, out, in)); a token touches
only the rows of its k experts.
"""

from __future__ import annotations

import numpy as np

from sparkinfer_cli.gguf.reader import GGUFError
from sparkinfer_cli.kernels.cpu import ops
from sparkinfer_cli.kernels.cpu.moe_routing import group_tokens_by_expert, route
from sparkinfer_cli.kernels.cpu.quant import matmul_row_invariant
from sparkinfer_cli.kernels.cpu.swiglu import swiglu
from sparkinfer_cli.model.config import ModelConfig
from sparkinfer_cli.model.layers import Linear, SwiGLU
from sparkinfer_cli.model.weights import QTensor, Weights


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

    def __init__(self, w: Weights, cfg: ModelConfig, layer: int):
        p, E = f"blk.{layer}.ffn_", cfg.n_embd
        self.shexp = SwiGLU(w, p, "_shexp", E, cfg.n_ff_shexp or cfg.n_ff)  # llama.cpp's fallback
        self.ffn_gate_inp_shexp = _shared_gate(w, p + "gate_inp_shexp.weight", E)  # (n_embd,)

    def __call__(self, y: np.ndarray) -> np.ndarray:
        # each token's dot summed along its own row (a GEMV over T rows may sum them by T)
        gate = ops.sigmoid((y * self.ffn_gate_inp_shexp).sum(axis=-1))  # (T,)
        return self.shexp(y) * gate[:, None]


class MoE:
    """Routed SwiGLU experts, plus a gated shared expert (qwen35moe / qwen3next)."""

    def __init__(self, w: Weights, cfg: ModelConfig, layer: int, shared_expert: bool):
        p, E, n = f"blk.{layer}.ffn_", cfg.n_embd, cfg.n_expert
        ff = cfg.n_ff_exp or cfg.n_ff // cfg.n_expert_used  # llama.cpp's fallback width
        self.n_expert, self.n_expert_used = n, cfg.n_expert_used
        self.ffn_gate_inp = Linear(w.get(p + "gate_inp.weight", (E, n)))
        gate, up = _gate_and_up_experts(w, p, E, ff, n)
        self.ffn_gate_exps, self.ffn_up_exps = ExpertLinear(gate), ExpertLinear(up)
        self.ffn_down_exps = ExpertLinear(w.get(p + "down_exps.weight", (ff, E, n)))
        self.shared = SharedExpert(w, cfg, layer) if shared_expert else None

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


def _gate_and_up_experts(w: Weights, p: str, E: int, ff: int, n: int) -> tuple[QTensor, QTensor]:
    """ffn_gate_exps and ffn_up_exps, or both as views of a fused ffn_gate_up_exps
    (--fuse-gate-up-exps: per expert, the ff gate rows, then the ff up rows)."""
    fused = w.optional(p + "gate_up_exps.weight", (E, 2 * ff, n))
    if fused is None:
        return w.get(p + "gate_exps.weight", (E, ff, n)), w.get(p + "up_exps.weight", (E, ff, n))
    return (QTensor(p + "gate_exps.weight", fused.ggml_type, (E, ff, n), fused.raw[:, :ff]),
            QTensor(p + "up_exps.weight", fused.ggml_type, (E, ff, n), fused.raw[:, ff:]))


def _shared_gate(w: Weights, name: str, n_embd: int) -> np.ndarray:
    """ffn_gate_inp_shexp as a (n_embd,) vector; files store it as [E] or [E, 1]."""
    t = w.get(name)
    if t.shape not in ((n_embd,), (n_embd, 1)):
        raise GGUFError(f"tensor {name!r} has shape {list(t.shape)}, expected [{n_embd}] "
                        f"or [{n_embd}, 1]")
    return np.ascontiguousarray(t.as_f32().reshape(n_embd))
