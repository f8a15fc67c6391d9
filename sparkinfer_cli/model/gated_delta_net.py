"""The Gated DeltaNet mixer of qwen35 / qwen35moe / qwen3next (llama.cpp's delta-net-base.cpp).

Per token, in GGUF head order:

    m = attn_qkv · x  (conv_dim = [q | k | v]);   z = attn_gate · x  (value_dim)
    β = sigmoid(ssm_beta · x);   g = ssm_a · softplus(ssm_alpha · x + ssm_dt)   (per v-head)
    u = silu(causal_conv(conv state | m));   q, k = l2norm(u_q), l2norm(u_k);   v = u_v
    o = delta rule (per v-head h, with q/k head h mod H_k or h / (H_v/H_k))
    out = ssm_out · (rms_norm(o_h, ssm_norm) ⊙ silu(z_h))

Every sequence carries its conv + delta state in its ModelCache slot; a new sequence (start 0)
begins from zeros. Prefill runs the exact recurrence over the prompt (llama.cpp's own prefill).
"""

from __future__ import annotations

import numpy as np

from sparkinfer_cli.kernels.cpu import ops
from sparkinfer_cli.kernels.cpu.gated_delta import (
    causal_conv1d_silu,
    gated_delta_recurrent,
    l2_normalize,
)
from sparkinfer_cli.model.batch import SequenceSpan
from sparkinfer_cli.model.config import ModelConfig
from sparkinfer_cli.model.layers import Forward, Linear, RMSNorm
from sparkinfer_cli.model.weights import QTensor, Weights


class GatedDeltaNet:
    def __init__(self, w: Weights, cfg: ModelConfig, layer: int, head_map: str):
        p, E, H_v = f"blk.{layer}.", cfg.n_embd, cfg.ssm_n_v_heads
        self.H_k, self.H_v, self.d_k = cfg.ssm_n_group, H_v, cfg.ssm_d_state
        self.d_v = cfg.ssm_inner_size // H_v
        self.key_dim, self.value_dim = self.H_k * self.d_k, cfg.ssm_inner_size
        self.layer, self.head_map, self.eps = layer, head_map, cfg.rms_eps
        qkv, gate = _input_projections(w, p, cfg)
        self.attn_qkv, self.attn_gate = Linear(qkv), Linear(gate)
        beta, alpha = _beta_alpha_projections(w, p, cfg)
        self.ssm_beta, self.ssm_alpha = Linear(beta), Linear(alpha)
        conv = w.get(p + "ssm_conv1d.weight", (cfg.ssm_conv_kernel, cfg.ssm_conv_dim))
        self.ssm_conv1d = np.ascontiguousarray(conv.as_f32())  # (conv_dim, K)
        self.ssm_dt = w.get(p + "ssm_dt.bias", (H_v,)).as_f32()
        self.ssm_a = w.get(p + "ssm_a", (H_v,)).as_f32()  # −exp(A_log)
        self.ssm_norm = RMSNorm(w.get(p + "ssm_norm.weight", (self.d_v,)), cfg.rms_eps)
        self.ssm_out = Linear(w.get(p + "ssm_out.weight", (self.value_dim, E)))

    def __call__(self, x: np.ndarray, fwd: Forward) -> np.ndarray:
        N = len(x)
        mixed, z = self.attn_qkv(x), self.attn_gate(x)  # (N, conv_dim), (N, value_dim)
        beta = ops.sigmoid(self.ssm_beta(x))  # (N, H_v)
        g = self.ssm_a * ops.softplus(self.ssm_alpha(x) + self.ssm_dt)  # (N, H_v) log-decay ≤ 0
        o = np.empty((N, self.H_v, self.d_v), dtype=np.float32)  # (N, H_v, d_v)
        for s in fwd.spans:
            o[s.lo:s.hi] = self.run_sequence(mixed[s.lo:s.hi], g[s.lo:s.hi], beta[s.lo:s.hi],
                                             s, fwd)
        gated = self.ssm_norm(o) * ops.silu(z.reshape(N, self.H_v, self.d_v))  # (N, H_v, d_v)
        return self.ssm_out(gated.reshape(N, self.value_dim))

    def run_sequence(self, mixed: np.ndarray, g: np.ndarray, beta: np.ndarray, s: SequenceSpan,
                     fwd: Forward) -> np.ndarray:
        """Conv + delta rule over one sequence's new tokens, advancing its state slot."""
        conv_state, delta_state = fwd.cache.recurrent_state(self.layer, s.state_slot)
        if s.start == 0:  # NOTE: a sequence at position 0 has no history, whatever the slot held
            conv_state[:] = 0
            delta_state[:] = 0
        T, kd = len(mixed), self.key_dim
        u = causal_conv1d_silu(mixed, conv_state, self.ssm_conv1d)  # (T, conv_dim)
        q = l2_normalize(u[:, :kd].reshape(T, self.H_k, self.d_k), self.eps)  # (T, H_k, d_k)
        k = l2_normalize(u[:, kd:2 * kd].reshape(T, self.H_k, self.d_k), self.eps)
        v = np.ascontiguousarray(u[:, 2 * kd:].reshape(T, self.H_v, self.d_v))  # (T, H_v, d_v)
        return gated_delta_recurrent(q, k, v, g, beta, delta_state, self.head_map)


# ---- loading: the fused layouts of older qwen3next files are split into the per-role tensors ----

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

