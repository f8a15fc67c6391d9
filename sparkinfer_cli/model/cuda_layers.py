"""The CPU model's layers on the GPU: each reads the normed input ws.x and writes ws.delta.

Built from the CPU layer objects (model/layers.py, moe.py, gated_attention.py, gated_delta_net.py),
whose math they mirror; see those files for the formulas. All launches go to `stream` and use only
workspace / cache buffers, so the same calls run eagerly (prefill) or inside a CUDA graph (decode).
"""

from __future__ import annotations

import numpy as np

from sparkinfer_cli.kernels.cuda import activation, attention, gated_delta, moe, norm, rope
from sparkinfer_cli.kernels.cuda import quant_gemv as qg
from sparkinfer_cli.model.config import ROPE_NEOX, ModelConfig
from sparkinfer_cli.model.cuda_cache import CudaModelCache
from sparkinfer_cli.model.cuda_weights import DeviceLinear, Uploader
from sparkinfer_cli.model.cuda_workspace import Workspace
from sparkinfer_cli.model.gated_delta_net import GatedDeltaNet
from sparkinfer_cli.model.layers import Attention, SwiGLU
from sparkinfer_cli.model.moe import MoE


class CudaSwiGLU:
    def __init__(self, up: Uploader, ffn: SwiGLU, name: str):
        self.gate, self.up = up.linear(ffn.ffn_gate), up.linear(ffn.ffn_up)
        self.down = up.linear(ffn.ffn_down)
        self.fused = self.gate.matrix.ggml_type == self.up.matrix.ggml_type
        self.name = name

    def __call__(self, ws: Workspace, stream, out=None) -> None:
        """out (default ws.delta) = down(silu(gate·x) ⊙ up·x) of x = ws.x."""
        out = ws.delta if out is None else out
        hidden = ws.act(self.name, self.gate.n_rows)
        if self.fused:
            ws.linear(self.gate, ws.x, hidden.f, stream, up=self.up)
        else:
            up = ws.buf(self.name + ".up", *hidden.f.shape)
            ws.linear(self.gate, ws.x, hidden.f, stream)
            ws.linear(self.up, ws.x, up, stream)
            activation.swiglu(hidden.f, up, hidden.f, stream=stream)
        hidden.quantize(stream)
        ws.linear(self.down, hidden, out, stream)


class CudaMoE:
    """Router top-k on the device; expert GEMVs read only the selected experts (slot_mat = ids)."""

    def __init__(self, up: Uploader, ffn: MoE, config: ModelConfig):
        self.router = up.linear(ffn.ffn_gate_inp)
        self.gate = DeviceLinear(up.matrix(ffn.ffn_gate_exps.weight))
        self.up = DeviceLinear(up.matrix(ffn.ffn_up_exps.weight))
        self.down = DeviceLinear(up.matrix(ffn.ffn_down_exps.weight))
        self.k, self.n_expert = ffn.n_expert_used, ffn.n_expert
        self.fused = self.gate.matrix.ggml_type == self.up.matrix.ggml_type
        self.shared = self.shared_gate = None
        if ffn.shared is not None:
            self.shared = CudaSwiGLU(up, ffn.shared.shexp, "shexp")
            self.shared_gate = DeviceLinear(up.vector_matrix(ffn.shared.ffn_gate_inp_shexp))

    def __call__(self, ws: Workspace, stream) -> None:
        rows, k = ws.n_rows, self.k
        logits = ws.buf("router", ws.groups, ws.cols, self.n_expert)
        ws.linear(self.router, ws.x, logits, stream)
        ids, weights = ws.buf("moe.ids", rows, k, dtype=np.int32), ws.buf("moe.w", rows, k)
        moe.router_topk(logits.reshape(rows, self.n_expert), k, ids, weights, stream=stream)
        slots = ids.reshape(rows * k)
        hidden = ws.act("moe.hidden", self.gate.n_rows, rows * k, 1)  # (slots, 1, ff)
        token_of_slot = ws.iota(rows * k, k)
        self._experts(ws, self.gate, ws.x.as_rows(), hidden.f, slots, token_of_slot, stream)
        hidden.quantize(stream)
        down = ws.buf("moe.down", rows * k, 1, self.down.n_rows)
        self._expert_gemv(self.down, hidden, down, slots, ws.iota(rows * k), stream)
        moe.moe_combine(down.reshape(rows * k, -1), weights, ws.delta.reshape(rows, -1),
                        stream=stream)
        if self.shared is not None:
            self._add_shared(ws, stream)

    def _experts(self, ws, gate, x, hidden, slots, token_of_slot, stream) -> None:
        """hidden (slots, 1, ff) = silu(gate_e·x) ⊙ (up_e·x) for each slot's expert e."""
        if self.fused:
            self._expert_gemv(gate, x, hidden, slots, token_of_slot, stream, up=self.up)
            return
        up = ws.buf("moe.up", *hidden.shape)
        self._expert_gemv(gate, x, hidden, slots, token_of_slot, stream)
        self._expert_gemv(self.up, x, up, slots, token_of_slot, stream)
        activation.swiglu(hidden, up, hidden, stream=stream)

    @staticmethod
    def _expert_gemv(w: DeviceLinear, x, y, slots, slot_x, stream, up=None) -> None:
        qg.gemv(w.matrix, x.for_matrix(w.matrix), y, slot_mat=slots, slot_x=slot_x,
                up=None if up is None else up.matrix, stream=stream)

    def _add_shared(self, ws: Workspace, stream) -> None:
        shared = ws.buf("shexp.out", *ws.delta.shape)
        gate = ws.buf("shexp.gate", ws.groups, ws.cols, 1)
        self.shared(ws, stream, shared)
        ws.linear(self.shared_gate, ws.x, gate, stream)
        moe.add_gated(ws.delta.reshape(ws.n_rows, -1), shared.reshape(ws.n_rows, -1),
                      gate.reshape(ws.n_rows), stream=stream)


class CudaAttention:
    """GQA attention; optional: qwen3 q/k norms, qwen2 biases, the hybrids' sigmoid output gate."""

    def __init__(self, up: Uploader, mixer: Attention, config: ModelConfig):
        self.q, self.k = up.linear(mixer.attn_q), up.linear(mixer.attn_k)
        self.v, self.o = up.linear(mixer.attn_v), up.linear(mixer.attn_output)
        gate = getattr(mixer, "attn_q_gate", None)
        self.gate = up.linear(gate) if gate is not None else None
        has_norm = mixer.attn_q_norm is not None
        self.q_norm = up.f32(mixer.attn_q_norm.weight) if has_norm else None
        self.k_norm = up.f32(mixer.attn_k_norm.weight) if has_norm else None
        self.layer, self.cfg = mixer.layer, config

    def __call__(self, ws: Workspace, cache: CudaModelCache, stream) -> None:
        cfg, rows = self.cfg, ws.n_rows
        H, H_kv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        q = ws.buf("attn.q", ws.groups, ws.cols, H * D)
        k, v = (ws.buf(n, ws.groups, ws.cols, H_kv * D) for n in ("attn.k", "attn.v"))
        for lin, y in ((self.q, q), (self.k, k), (self.v, v)):
            ws.linear(lin, ws.x, y, stream)
        q, k, v = q.reshape(rows, H, D), k.reshape(rows, H_kv, D), v.reshape(rows, H_kv, D)
        if self.q_norm is not None:
            norm.rms_norm(q, self.q_norm, q, cfg.rms_eps, stream=stream)
            norm.rms_norm(k, self.k_norm, k, cfg.rms_eps, stream=stream)
        neox = cfg.rope_style == ROPE_NEOX
        for t in (q, k):
            rope.rope_neox(t, ws.positions, cfg.n_rot, cfg.rope_base, stream=stream, neox=neox)
        li = cache.attn_index[self.layer]
        attention.kv_store(k, v, cache.k[li], cache.v[li], ws.slot_mapping, stream=stream)
        out = ws.act("attn.out", H * D)
        attention.paged_decode_attention(q, cache.k[li], cache.v[li], ws.block_tables, ws.seq_lens,
                                         out.f.reshape(rows, H, D), ws.attn, stream=stream,
                                         row_seq=ws.row_seq)
        if self.gate is not None:
            gate = ws.buf("attn.gate", ws.groups, ws.cols, H * D)
            ws.linear(self.gate, ws.x, gate, stream)
            activation.sigmoid_mul(out.f, gate, out.f, stream=stream)
        out.quantize(stream)
        ws.linear(self.o, out, ws.delta, stream)


class CudaGatedDeltaNet:
    def __init__(self, up: Uploader, mixer: GatedDeltaNet, config: ModelConfig):
        m = mixer
        self.qkv, self.z = up.linear(m.attn_qkv), up.linear(m.attn_gate)
        self.beta, self.alpha = up.linear(m.ssm_beta), up.linear(m.ssm_alpha)
        self.conv_w, self.dt, self.a = up.f32(m.ssm_conv1d), up.f32(m.ssm_dt), up.f32(m.ssm_a)
        self.norm_w, self.out = up.f32(m.ssm_norm.weight), up.linear(m.ssm_out)
        self.H_k, self.H_v, self.d_v = m.H_k, m.H_v, m.d_v
        self.head_map_mod, self.eps, self.layer = m.head_map == "mod", m.eps, m.layer

    def __call__(self, ws: Workspace, cache: CudaModelCache, stream) -> None:
        rows, G, C = ws.n_rows, ws.groups, ws.cols
        mixed = ws.buf("gdn.mixed", G, C, self.qkv.n_rows)
        z = ws.buf("gdn.z", G, C, self.z.n_rows)
        a, b = (ws.buf(n, G, C, self.H_v) for n in ("gdn.a", "gdn.b"))
        for lin, y in ((self.qkv, mixed), (self.z, z), (self.alpha, a), (self.beta, b)):
            ws.linear(lin, ws.x, y, stream)
        li = cache.rec_index[self.layer]
        u = ws.buf("gdn.u", rows, self.qkv.n_rows)
        gated_delta.conv_silu_seq(mixed.reshape(rows, -1), self.conv_w, cache.conv_state[li],
                                  ws.state_slots, ws.seq_lo, ws.seq_n, u, stream=stream)
        o = ws.buf("gdn.o", rows, self.H_v, self.d_v)
        gated_delta.delta_rule_seq(u, a.reshape(rows, -1), b.reshape(rows, -1), self.a, self.dt,
                                   cache.delta_state[li], ws.state_slots, ws.seq_lo, ws.seq_n, o,
                                   n_k_heads=self.H_k, head_map_mod=self.head_map_mod,
                                   eps=self.eps, stream=stream)
        y = ws.act("gdn.y", self.z.n_rows)
        norm.rms_norm_silu_gate(o.reshape(G, C, -1), z, self.norm_w, y.f, self.eps, stream=stream)
        y.quantize(stream)
        ws.linear(self.out, y, ws.delta, stream)
