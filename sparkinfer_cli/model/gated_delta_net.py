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
from sparkinfer_cli.model.tensors import DeltaNetTensors


class GatedDeltaNet:
    def __init__(self, t: DeltaNetTensors, cfg: ModelConfig, layer: int):
        H_v = cfg.ssm_n_v_heads
        self.H_k, self.H_v, self.d_k = cfg.ssm_n_group, H_v, cfg.ssm_d_state
        self.d_v = cfg.ssm_inner_size // H_v
        self.key_dim, self.value_dim = self.H_k * self.d_k, cfg.ssm_inner_size
        self.layer, self.head_map, self.eps = layer, t.head_map, cfg.rms_eps
        self.attn_qkv, self.attn_gate = Linear(t.qkv), Linear(t.z)
        self.ssm_beta, self.ssm_alpha = Linear(t.beta), Linear(t.alpha)
        self.ssm_conv1d = np.ascontiguousarray(t.conv1d.as_f32())  # (conv_dim, K)
        self.ssm_dt = t.dt.as_f32()
        self.ssm_a = t.a.as_f32()  # −exp(A_log)
        self.ssm_norm = RMSNorm(t.norm, cfg.rms_eps)
        self.ssm_out = Linear(t.out)

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
        """Conv + delta rule over one sequence's new tokens, advancing its state slot; the state
        after each row a draft state slot stands for is copied there."""
        conv_state, delta_state = fwd.cache.recurrent_state(self.layer, s.state_slot)
        if s.start == 0:  # NOTE: a sequence at position 0 has no history, whatever the slot held
            conv_state[:] = 0
            delta_state[:] = 0
        T = len(mixed)
        ends = [T - len(s.draft_state_slots) + i for i in range(len(s.draft_state_slots))] + [T]
        pieces, lo = [], 0
        for end, slot in zip(ends, (*s.draft_state_slots, None)):
            pieces.append(self._advance(mixed[lo:end], g[lo:end], beta[lo:end], conv_state,
                                        delta_state))
            if slot is not None:
                for state, kept in zip(fwd.cache.recurrent_state(self.layer, slot),
                                       (conv_state, delta_state)):
                    state[:] = kept
            lo = end
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def _advance(self, mixed: np.ndarray, g: np.ndarray, beta: np.ndarray,
                 conv_state: np.ndarray, delta_state: np.ndarray) -> np.ndarray:
        """(T, H_v, d_v) outputs of T tokens; the states advance over them in place."""
        T, kd = len(mixed), self.key_dim
        u = causal_conv1d_silu(mixed, conv_state, self.ssm_conv1d)  # (T, conv_dim)
        q = l2_normalize(u[:, :kd].reshape(T, self.H_k, self.d_k), self.eps)  # (T, H_k, d_k)
        k = l2_normalize(u[:, kd:2 * kd].reshape(T, self.H_k, self.d_k), self.eps)
        v = np.ascontiguousarray(u[:, 2 * kd:].reshape(T, self.H_v, self.d_v))  # (T, H_v, d_v)
        return gated_delta_recurrent(q, k, v, g, beta, delta_state, self.head_map)
