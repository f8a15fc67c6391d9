"""The model's layers on the GPU: each reads the normed input ws.x and writes ws.delta.

Built from the tensor records (model/tensors.py); their math is the CPU layers' (model/layers.py,
moe.py, gated_attention.py, gated_delta_net.py); see those files for the formulas. All launches go
to `stream` and use only workspace / cache buffers, so the same calls run eagerly (prefill) or
inside a CUDA graph (decode).
"""

from __future__ import annotations

import numpy as np

from sparkinfer_cli import env
from sparkinfer_cli.backend.cuda.cache import CudaModelCache
from sparkinfer_cli.backend.cuda.linears import DeviceLinear, sums_in_fixed_order
from sparkinfer_cli.backend.cuda.weights import Uploader, one_row
from sparkinfer_cli.backend.cuda.workspace import Workspace
from sparkinfer_cli.kernels.cuda import (
    activation,
    attention,
    attention_flash,
    attention_prefill,
    gated_delta,
    gated_delta_chunked,
    mma_gemm,
    mmq_k,
    moe,
    norm,
)
from sparkinfer_cli.kernels.cuda import quant_gemv as qg
from sparkinfer_cli.kernels.cuda.attention_input import prepare_attention_input
from sparkinfer_cli.kernels.cuda.expert_route import ExpertRoute, route_experts
from sparkinfer_cli.kernels.cuda.runtime import graphs
from sparkinfer_cli.model.config import ROPE_NEOX, ModelConfig
from sparkinfer_cli.model.tensors import (
    AttentionTensors,
    DeltaNetTensors,
    MoETensors,
    SwiGLUTensors,
)
from sparkinfer_cli.model.weights import QTensor


class CudaSwiGLU:
    def __init__(self, up: Uploader, t: SwiGLUTensors, name: str):
        self.gate, self.up = up.linear(t.gate), up.linear(t.up)
        self.down = up.linear(t.down, prefill=True)
        self.fused = self.gate.matrix.ggml_type == self.up.matrix.ggml_type
        self.name = name

    def __call__(self, ws: Workspace, stream, out=None) -> None:
        """out (default ws.delta) = down(silu(gate·x) ⊙ up·x) of x = ws.x."""
        out = ws.delta if out is None else out
        hidden = ws.act(self.name, self.gate.n_rows)
        if self.fused:
            self.gate(ws, ws.x, hidden.f, stream, up=self.up)
        else:
            up = ws.buf(self.name + ".up", *hidden.f.shape)
            self.gate(ws, ws.x, hidden.f, stream)
            self.up(ws, ws.x, up, stream)
            activation.swiglu(hidden.f, up, hidden.f, stream=stream)
        hidden.quantize(stream)
        self.down(ws, hidden, out, stream)

    @staticmethod
    def add_norm(ws: Workspace, norm_w, eps: float, stream, act) -> None:
        """h += this block's output; x = rms_norm(h)·norm_w (the next sub-layer's input)."""
        norm.add_rms_norm(ws.delta, ws.h, norm_w, ws.x.f, eps, stream=stream, act=act)


class CudaMoE:
    """Router top-k on the device; decode passes run one GEMV per (token, expert) slot reading
    only the selected experts (slot_mat = ids), prefills of ≥ EXPERTS_MMA_MIN_ROWS tokens sort
    the slots by expert and run tensor-core GEMMs per expert tile.

    The weighted combine of the experts (and the gated shared expert) is left to `add_norm`, which
    folds it into the next pre-norm's residual add: one launch instead of three."""

    def __init__(self, up: Uploader, t: MoETensors, config: ModelConfig):
        self.gate = DeviceLinear(up.matrix(t.gate_exps))
        self.up = DeviceLinear(up.matrix(t.up_exps))
        self.down = DeviceLinear(up.matrix(t.down_exps))
        self.k, self.n_expert = config.n_expert_used, config.n_expert
        self.int8_experts = env.SPARKINFER_INT8_EXPERTS.get()
        self.fused = self.gate.matrix.ggml_type == self.up.matrix.ggml_type
        self.shared = None
        routers: list[tuple[QTensor, QTensor | None]] = [(t.router, None)]
        if t.shared is not None:
            self.shared = CudaSwiGLU(up, t.shared.ffn, "shexp")
            routers.append((one_row(t.shared.gate), None))  # the shared gate logit
        self.routers = up.stacked(routers)

    def __call__(self, ws: Workspace, stream) -> None:
        """The shared expert runs on the side stream beside the router and routed experts (each
        chain is a few latency-bound launches that leave most of the GPU idle at decode)."""
        if self.shared is not None:
            side = graphs.side_stream()
            self.shared(ws, side.fork(stream), self._shared_out(ws))
            self._routed(ws, stream)
            side.join(stream)
        else:
            self._routed(ws, stream)

    def _routed(self, ws: Workspace, stream) -> None:
        rows, k = ws.n_rows, self.k
        logits = self.routers(ws, ws.x, ("router", "shexp.gate"), stream,
                            beside=False)[0]  # the side stream runs the shared expert
        ids, weights = self._picks(ws)
        moe.router_topk(logits.reshape(rows, self.n_expert), k, ids, weights, stream=stream)
        route = self._route(ws, stream)
        hidden = ws.act("moe.hidden", self.gate.n_rows, rows * k, 1)  # (slots, 1, ff)
        self._experts(ws, route, ws.x.as_rows(), hidden.f, ws.iota(rows * k, k), stream)
        if self._reads_q8(route, self.down):
            hidden.quantize(stream)
        self._expert_gemv(ws, route, self.down, hidden, self._down(ws), ws.iota(rows * k), stream)

    def _route(self, ws: Workspace, stream) -> ExpertRoute | None:
        """Prefills: this pass's slots sorted by expert into tensor-core GEMM tiles. None for
        decode: per-slot GEMVs measured faster than GEMVs per expert tile at 64 sequences
        (bench/probes/cuda_gemv_bench.py: a slot's expert re-read comes from L2)."""
        if not self.gate.on_tensor_cores(ws, ws.n_rows, experts=True):
            return None
        n_slots = ws.n_rows * self.k
        tile = mma_gemm.expert_tile(n_slots, self.n_expert, self.gate.matrix)
        if self._takes_int8(self.gate) or self._takes_int8(self.down):
            tile = min(tile, mmq_k.BN)
        route = ws.expert_route(self.n_expert, n_slots, tile)
        route_experts(self._picks(ws)[0].reshape(n_slots), n_slots, route, stream)
        return route

    def add_norm(self, ws: Workspace, norm_w, eps: float, stream, act) -> None:
        """h += Σ_r w_r·expert_r (+ sigmoid(g)·shared); x = rms_norm(h)·norm_w."""
        rows = ws.n_rows
        shared = {}
        if self.shared is not None:
            shared = {"shared": self._shared_out(ws).reshape(rows, -1),
                      "shared_gate": ws.buf("shexp.gate", ws.groups, ws.cols, 1).reshape(rows)}
        norm.moe_add_rms_norm(self._down(ws).reshape(rows * self.k, -1), self._picks(ws)[1],
                              ws.h.reshape(rows, -1), norm_w, ws.x.f.reshape(rows, -1), eps,
                              stream=stream, act=act, **shared)

    def _picks(self, ws: Workspace):
        """The step's expert ids (rows, k) int32 and their renormalised weights (rows, k)."""
        return (ws.buf("moe.ids", ws.n_rows, self.k, dtype=np.int32),
                ws.buf("moe.w", ws.n_rows, self.k))

    def _down(self, ws: Workspace):
        return ws.buf("moe.down", ws.n_rows * self.k, 1, self.down.n_rows)

    @staticmethod
    def _shared_out(ws: Workspace):
        return ws.buf("shexp.out", *ws.delta.shape)

    def _experts(self, ws, route, x, hidden, token_of_slot, stream) -> None:
        """hidden (slots, 1, ff) = silu(gate_e·x) ⊙ (up_e·x) for each slot's expert e."""
        if self.fused:
            self._expert_gemv(ws, route, self.gate, x, hidden, token_of_slot, stream, up=self.up)
            return
        up = ws.buf("moe.up", *hidden.shape)
        self._expert_gemv(ws, route, self.gate, x, hidden, token_of_slot, stream)
        self._expert_gemv(ws, route, self.up, x, up, token_of_slot, stream)
        activation.swiglu(hidden, up, hidden, stream=stream)

    @staticmethod
    def _on_tensor_cores(route: ExpertRoute | None, w: DeviceLinear) -> bool:
        return route is not None and mma_gemm.supports(w.matrix)

    def _on_int8_gemm(self, route: ExpertRoute | None, w: DeviceLinear) -> bool:
        """K-quant experts take the int8 grouped GEMM over q8 activations (mmq_k) where
        SPARKINFER_INT8_EXPERTS asks for it (see mmq_k for why it is not the default)."""
        return route is not None and self._takes_int8(w)

    def _takes_int8(self, w: DeviceLinear) -> bool:
        return self.int8_experts and mmq_k.supports(w.matrix)

    def _reads_q8(self, route: ExpertRoute | None, w: DeviceLinear) -> bool:
        """Whether W's product reads the q8 activations: the GEMV's and the int8 GEMM."""
        return not self._on_tensor_cores(route, w) or self._on_int8_gemm(route, w)

    def _expert_gemv(self, ws, route, w: DeviceLinear, x, y, slot_x, stream, up=None) -> None:
        """y[slot] = W[expert(slot)]·x[slot_x[slot]]: tensor-core GEMMs per expert tile when
        routed, else one GEMV per slot reading only the selected experts (slot_mat = ids)."""
        up_matrix = None if up is None else up.matrix
        n_slots = y.shape[0]
        if self._on_int8_gemm(route, w):
            mmq_k.grouped_matmul(w.matrix, x.q, y.reshape(n_slots, -1), route, slot_x,
                                 up=up_matrix, stream=stream)
        elif self._on_tensor_cores(route, w):
            mma_gemm.grouped_matmul(w.matrix, x.f.reshape(x.f.shape[0] * x.f.shape[1], -1),
                                    y.reshape(n_slots, -1), route, slot_x, up=up_matrix,
                                    stream=stream)
        else:
            qg.gemv(w.matrix, x.for_matrix(w.matrix), y, slot_x=slot_x, up=up_matrix,
                    slot_mat=self._picks(ws)[0].reshape(n_slots), stream=stream,
                    fixed_order=sums_in_fixed_order(ws))


class CudaAttention:
    """GQA attention; optional: qwen3 q/k norms, qwen2 biases, the hybrids' sigmoid output gate."""

    def __init__(self, up: Uploader, t: AttentionTensors, config: ModelConfig, layer: int):
        self.gated = t.q_gate is not None
        members: list[tuple[QTensor, QTensor | None]] = [(t.q, t.q_bias), (t.k, t.k_bias),
                                                         (t.v, t.v_bias)]
        if t.q_gate is not None:
            members.append((t.q_gate, None))
        self.qkv = up.stacked(members, prefill=True)
        self.o = up.linear(t.output, prefill=True)
        self.q_norm = up.vector(t.q_norm) if t.q_norm is not None else None
        self.k_norm = up.vector(t.k_norm) if t.k_norm is not None else None
        self.layer, self.cfg = layer, config

    def __call__(self, ws: Workspace, cache: CudaModelCache, stream) -> None:
        cfg, rows = self.cfg, ws.n_rows
        H, H_kv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        q, k, v, *gate = self.qkv(ws, ws.x, ("attn.q", "attn.k", "attn.v", "attn.gate"),
                                    stream)
        q, k, v = q.reshape(rows, H, D), k.reshape(rows, H_kv, D), v.reshape(rows, H_kv, D)
        kv = cache.kv.layer(cache.attn_index[self.layer])
        prepare_attention_input(q, k, v, self.q_norm, self.k_norm, cfg.rms_eps, ws.positions,
                                cfg.n_rot, cfg.rope_base, kv.k, kv.v, ws.slot_mapping,
                                neox=cfg.rope_style == ROPE_NEOX, scales=kv.scales,
                                stream=stream)
        out = ws.act("attn.out", H * D)
        args = (q, kv.k, kv.v, ws.block_tables, ws.seq_lens, out.f.reshape(rows, H, D))
        options = {"stream": stream, "row_seq": ws.row_seq, "scales": kv.scales}
        fused_q8 = None  # the q8 activations the attention kernel fills itself
        if ws.prefill_kernels and attention_flash.supports(H, H_kv, D, kv.k.dtype):
            attention_flash.flash_prefill_attention(*args, **options)  # on tensor cores
        elif ws.prefill_kernels and attention_prefill.supports(H, H_kv, D):  # share K/V tiles
            attention_prefill.prefill_attention(*args, **options)
        else:  # a query row at a time: keys split over blocks
            assert ws.attn is not None  # a workspace of a model with attention layers
            fused_q8 = None if self.gated else out.q
            attention.paged_decode_attention(*args, ws.attn, act=fused_q8,
                                             split_rows=ws.split_rows, **options)
        if self.gated:
            activation.sigmoid_mul(out.f, gate[0], out.f, stream=stream, act=out.q)
        elif fused_q8 is None:
            out.quantize(stream)
        self.o(ws, out, ws.delta, stream)


class CudaGatedDeltaNet:
    def __init__(self, up: Uploader, t: DeltaNetTensors, config: ModelConfig, layer: int):
        self.proj = up.stacked([(t.qkv, None), (t.z, None), (t.alpha, None), (t.beta, None)],
                               prefill=True)
        self.qkv_rows, self.z_rows = self.proj.n_rows[:2]
        self.conv_w, self.dt, self.a = up.vector(t.conv1d), up.vector(t.dt), up.vector(t.a)
        self.norm_w, self.out = up.vector(t.norm), up.linear(t.out, prefill=True)
        self.H_k, self.H_v = config.ssm_n_group, config.ssm_n_v_heads
        self.d_k, self.d_v = config.ssm_d_state, config.ssm_inner_size // self.H_v
        self.head_map_mod, self.eps, self.layer = t.head_map == "mod", config.rms_eps, layer
        self.chunked = env.SPARKINFER_GDN_CHUNKED.get()

    def __call__(self, ws: Workspace, cache: CudaModelCache, stream) -> None:
        rows, G, C = ws.n_rows, ws.groups, ws.cols
        mixed, z, a, b = self.proj(ws, ws.x, ("gdn.mixed", "gdn.z", "gdn.a", "gdn.b"),
                                    stream)
        li = cache.rec_index[self.layer]
        u = ws.buf("gdn.u", rows, self.qkv_rows)
        # passes whose rows are decodes' may check drafts: they keep the states a check asks for
        kept = ws.row_state_slots if ws.rows_as_decodes else None
        gated_delta.conv_silu_seq(mixed.reshape(rows, -1), self.conv_w, cache.conv_state[li],
                                  ws.state_slots, ws.seq_lo, ws.seq_n, u, stream=stream,
                                  row_state_slots=kept)
        o = ws.buf("gdn.o", rows, self.H_v, self.d_v)
        gated_delta.delta_rule_seq(u, a.reshape(rows, -1), b.reshape(rows, -1), self.a, self.dt,
                                   cache.delta_state[li], ws.state_slots, ws.seq_lo, ws.seq_n, o,
                                   n_k_heads=self.H_k, head_map_mod=self.head_map_mod,
                                   eps=self.eps, prepare=ws.prefill_kernels,
                                   chunks=self._chunked_pass(ws),
                                   row_state_slots=kept, stream=stream)
        y = ws.act("gdn.y", self.z_rows)
        norm.rms_norm_silu_gate(o.reshape(G, C, -1), z, self.norm_w, y.f, self.eps, stream=stream,
                                act=y.q)
        self.out(ws, y, ws.delta, stream)

    def _chunked_pass(self, ws: Workspace) -> gated_delta_chunked.ChunkedPass | None:
        """What the chunked kernels need where this pass takes them (SPARKINFER_GDN_CHUNKED, a
        prefill pass, heads they support), else None."""
        if not (self.chunked and ws.prefill_kernels and
                gated_delta_chunked.supports(self.d_k, self.d_v)):
            return None
        scratch = ws.buf("gdn.chunks", ws.n_rows, self.H_v,
                         gated_delta_chunked.scratch_cols(self.d_k, self.d_v))
        return gated_delta_chunked.ChunkedPass(scratch, ws.chunk_lo, ws.chunk_n)
