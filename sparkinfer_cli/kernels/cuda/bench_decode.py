"""Time one Qwen3.6-35B-A3B decode token (batch 1) of this package's kernels as one CUDA graph.

python -m sparkinfer_cli.kernels.cuda.bench_decode --ctx 512 32768
40 layers (30 Gated DeltaNet + 10 gated attention, each followed by a 256-expert top-8 MoE with a
shared expert) + output norm, 248320-row Q6_K output GEMV and greedy sampling, all on distinct
random weights in GGUF byte layouts (≈ 20 GB). Not a model: values are random, q/k norms run on
separate buffers, and each layer's experts are a fixed random top-8 (the router kernel runs and is
timed, but random weights would make real routing meaningless), so bytes moved match a real token.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from numba import cuda, uint32

from sparkinfer_cli.ggml_types import GGMLType, row_bytes
from sparkinfer_cli.kernels.cuda import (
    activation,
    attention,
    gated_delta,
    graphs,
    moe,
    norm,
    rope,
    sampling,
)
from sparkinfer_cli.kernels.cuda import quant_gemv as qg
from sparkinfer_cli.kernels.cuda.launch import cdiv

E, N_VOCAB, N_EXPERTS, TOP_K, FF = 2048, 248320, 256, 8, 512
H_K, H_V, DK, CONV = 16, 32, 128, 8192
N_HEADS, N_KV, HEAD_DIM, BLOCK = 16, 2, 256, 16
EPS = 1e-6


@cuda.jit
def _fill_random(buf, seed, mask):
    # xorshift-multiply hash per word; `mask` keeps every f16 half finite and small
    i = cuda.grid(1)
    if i < buf.size:
        h = uint32(i) * uint32(2654435761) ^ uint32(seed)
        h ^= h >> 15
        h *= uint32(2246822519)
        h ^= h >> 13
        buf[i] = h & mask


def random_device_bytes(n_bytes: int, seed: int):
    words = cuda.device_array(cdiv(n_bytes + 16, 16) * 4, np.uint32)  # (n_bytes + pad) / 4
    _fill_random[cdiv(words.size, 256), 256](words, seed, 0x2BFF2BFF)
    return words.view(np.uint8)


class Weights:
    """Random GGUF-layout matrices, one fresh buffer per call."""

    def __init__(self):
        self.seed = 1

    def quant(self, ggml_type, k, n_rows, n_mats=1):
        self.seed += 1
        data = random_device_bytes(n_mats * n_rows * row_bytes(ggml_type, k), self.seed)
        return qg.DeviceQuantMatrix(data, ggml_type, k, n_rows, n_mats)

    def f32(self, *shape):
        self.seed += 1
        return cuda.to_device((np.random.default_rng(self.seed).standard_normal(shape) * 0.05)
                              .astype(np.float32))


def zeros(*shape, dtype=np.float32):
    return cuda.to_device(np.zeros(shape, dtype))


class Buffers:
    """Static activations shared by all layers (what a decode graph would own)."""

    def __init__(self, max_ctx: int):
        self.h, self.delta, self.x = zeros(E), zeros(E), zeros(1, 1, E)
        self.act_e = qg.QuantizedActivations(1, 1, E)
        self.act_v = qg.QuantizedActivations(1, 1, 4096)
        self.mixed, self.u, self.z = zeros(1, 1, CONV), zeros(1, CONV), zeros(1, 1, 4096)
        self.a, self.b = zeros(1, 1, H_V), zeros(1, 1, H_V)
        self.o, self.y = zeros(1, H_V, DK), zeros(1, 1, 4096)
        self.router = zeros(1, 1, N_EXPERTS)
        self.ids, self.w = zeros(1, TOP_K, dtype=np.int32), zeros(1, TOP_K)
        self.g, self.up, self.ffa = zeros(TOP_K, 1, FF), zeros(TOP_K, 1, FF), zeros(TOP_K, 1, FF)
        self.act_ff = qg.QuantizedActivations(TOP_K, 1, FF)
        self.down = zeros(TOP_K, 1, E)
        self.sg, self.su, self.sa = zeros(1, 1, FF), zeros(1, 1, FF), zeros(1, 1, FF)
        self.act_sff = qg.QuantizedActivations(1, 1, FF)
        self.shared, self.gate1 = zeros(1, 1, E), zeros(1, 1, 1)
        self.slot_x = cuda.to_device(np.arange(TOP_K, dtype=np.int32))
        self.zero8 = zeros(TOP_K, dtype=np.int32)
        self.state_slot = zeros(1, dtype=np.int32)
        self.q, self.qg, self.k, self.v = zeros(1, 1, 8192), zeros(1, N_HEADS, HEAD_DIM), zeros(
            1, 1, 512), zeros(1, 1, 512)
        self.attn = zeros(1, N_HEADS, HEAD_DIM)
        self.pos, self.seq_len = zeros(1, dtype=np.int32), zeros(1, dtype=np.int32)
        self.slot = zeros(1, dtype=np.int32)
        n_blocks = cdiv(max_ctx + 1, BLOCK)
        self.block_table = cuda.to_device(np.arange(n_blocks, dtype=np.int32).reshape(1, -1))
        self.ws = attention.DecodeWorkspace(1, N_HEADS, HEAD_DIM, max_ctx + 1)
        self.logits = zeros(1, 1, N_VOCAB)
        self.temp, self.top_k = zeros(1), zeros(1, dtype=np.int32)
        self.top_p, self.min_p, self.unif = zeros(1), zeros(1), zeros(1)
        self.token = zeros(1, dtype=np.int32)
        self.sampling = sampling.SamplingWorkspace(1, N_VOCAB)


class MoE:
    def __init__(self, wt: Weights, rng):
        self.norm = wt.f32(E)
        self.router = wt.quant(GGMLType.F32, E, N_EXPERTS)
        self.gate = wt.quant(GGMLType.Q4_K, E, FF, N_EXPERTS)
        self.up = wt.quant(GGMLType.Q4_K, E, FF, N_EXPERTS)
        self.down = wt.quant(GGMLType.Q5_K, FF, E, N_EXPERTS)
        self.experts = cuda.to_device(rng.choice(N_EXPERTS, TOP_K, replace=False).astype(np.int32))
        self.sh_gate = wt.quant(GGMLType.Q8_0, E, FF)
        self.sh_up = wt.quant(GGMLType.Q8_0, E, FF)
        self.sh_down = wt.quant(GGMLType.Q8_0, FF, E)
        self.sh_inp = wt.quant(GGMLType.F32, E, 1)

    def __call__(self, b: Buffers, s):
        norm.add_rms_norm(b.delta, b.h, self.norm, b.x.reshape(E), EPS, stream=s,
                          act=b.act_e)
        qg.gemv(self.router, b.x, b.router, stream=s)
        moe.router_topk(b.router.reshape(1, N_EXPERTS), TOP_K, b.ids, b.w, stream=s)
        # every expert slot reads the token's activations through slot_x = 0
        qg.gemv(self.gate, b.act_e, b.ffa, slot_mat=self.experts, slot_x=b.zero8, up=self.up,
                stream=s)
        qg.quantize_activations(b.ffa, b.act_ff, stream=s)
        qg.gemv(self.down, b.act_ff, b.down, slot_mat=self.experts, slot_x=b.slot_x, stream=s)
        qg.gemv(self.sh_gate, b.act_e, b.sa, up=self.sh_up, stream=s)
        qg.quantize_activations(b.sa, b.act_sff, stream=s)
        qg.gemv(self.sh_down, b.act_sff, b.shared, stream=s)
        qg.gemv(self.sh_inp, b.x, b.gate1, stream=s)
        moe.moe_combine(b.down.reshape(TOP_K, E), b.w, b.delta.reshape(1, E), stream=s)
        moe.add_gated(b.delta.reshape(1, E), b.shared.reshape(1, E), b.gate1.reshape(1), stream=s)


class GDNLayer:
    def __init__(self, wt: Weights, rng):
        self.norm = wt.f32(E)
        self.qkv = wt.quant(GGMLType.Q8_0, E, CONV)
        self.gate = wt.quant(GGMLType.Q8_0, E, 4096)
        self.alpha = wt.quant(GGMLType.Q8_0, E, H_V)
        self.beta = wt.quant(GGMLType.Q8_0, E, H_V)
        self.conv_w = wt.f32(CONV, 4)
        self.ssm_a, self.dt = wt.f32(H_V), wt.f32(H_V)
        self.ssm_norm = wt.f32(DK)
        self.out = wt.quant(GGMLType.Q8_0, 4096, E)
        self.conv_state, self.state = zeros(1, CONV, 3), zeros(1, H_V, DK, DK)
        self.moe = MoE(wt, rng)

    def __call__(self, b: Buffers, s):
        norm.add_rms_norm(b.delta, b.h, self.norm, b.x.reshape(E), EPS, stream=s,
                          act=b.act_e)
        for w, y in ((self.qkv, b.mixed), (self.gate, b.z), (self.alpha, b.a), (self.beta, b.b)):
            qg.gemv(w, b.act_e, y, stream=s)
        gated_delta.conv_silu_step(b.mixed.reshape(1, CONV), self.conv_w, self.conv_state,
                                   b.state_slot, b.u, stream=s)
        gated_delta.delta_rule_step(b.u, b.a.reshape(1, H_V), b.b.reshape(1, H_V), self.ssm_a,
                                    self.dt, self.state, b.state_slot, b.o, n_k_heads=H_K,
                                    head_map_mod=True, eps=EPS, stream=s)
        norm.rms_norm_silu_gate(b.o.reshape(1, 1, 4096), b.z, self.ssm_norm, b.y, EPS, stream=s)
        qg.quantize_activations(b.y, b.act_v, stream=s)
        qg.gemv(self.out, b.act_v, b.delta.reshape(1, 1, E), stream=s)
        self.moe(b, s)


class AttnLayer:
    def __init__(self, wt: Weights, rng, max_ctx: int):
        self.norm = wt.f32(E)
        self.q = wt.quant(GGMLType.Q8_0, E, 8192)
        self.k = wt.quant(GGMLType.Q8_0, E, 512)
        self.v = wt.quant(GGMLType.Q8_0, E, 512)
        self.q_norm, self.k_norm = wt.f32(HEAD_DIM), wt.f32(HEAD_DIM)
        self.out = wt.quant(GGMLType.Q8_0, 4096, E)
        n_blocks = cdiv(max_ctx + 1, BLOCK)
        self.k_cache = cuda.to_device(np.zeros((n_blocks, BLOCK, N_KV, HEAD_DIM), np.float16))
        self.v_cache = cuda.to_device(np.zeros((n_blocks, BLOCK, N_KV, HEAD_DIM), np.float16))
        self.moe = MoE(wt, rng)

    def __call__(self, b: Buffers, s):
        norm.add_rms_norm(b.delta, b.h, self.norm, b.x.reshape(E), EPS, stream=s,
                          act=b.act_e)
        for w, y in ((self.q, b.q), (self.k, b.k), (self.v, b.v)):
            qg.gemv(w, b.act_e, y, stream=s)
        q, gate = b.q.reshape(8192)[:4096], b.q.reshape(8192)[4096:]
        norm.rms_norm(q.reshape(1, N_HEADS, HEAD_DIM), self.q_norm, b.qg, EPS, stream=s)
        k = b.k.reshape(1, N_KV, HEAD_DIM)
        norm.rms_norm(k, self.k_norm, k, EPS, stream=s)
        rope.rope_neox(b.qg, b.pos, 64, 1e7, stream=s)
        rope.rope_neox(k, b.pos, 64, 1e7, stream=s)
        attention.kv_store(k, b.v.reshape(1, N_KV, HEAD_DIM), self.k_cache, self.v_cache, b.slot,
                           stream=s)
        attention.paged_decode_attention(b.qg, self.k_cache, self.v_cache, b.block_table,
                                         b.seq_len, b.attn, b.ws, stream=s)
        activation.sigmoid_mul(b.attn.reshape(4096), gate, b.y.reshape(4096), stream=s)
        qg.quantize_activations(b.y, b.act_v, stream=s)
        qg.gemv(self.out, b.act_v, b.delta.reshape(1, 1, E), stream=s)
        self.moe(b, s)


def build(max_ctx: int):
    rng = np.random.default_rng(0)
    wt = Weights()
    layers = [AttnLayer(wt, rng, max_ctx) if (i + 1) % 4 == 0 else GDNLayer(wt, rng)
              for i in range(40)]
    out_norm, output = wt.f32(E), wt.quant(GGMLType.Q6_K, E, N_VOCAB)
    b = Buffers(max_ctx)

    def token(s):
        for layer in layers:
            layer(b, s)
        norm.add_rms_norm(b.delta, b.h, out_norm, b.x.reshape(E), EPS, stream=s,
                          act=b.act_e)
        qg.gemv(output, b.act_e, b.logits, stream=s)
        sampling.sample(b.logits.reshape(1, N_VOCAB), b.temp, b.top_k, b.top_p, b.min_p, b.unif,
                        b.token, b.sampling, stream=s)
    return token, b, layers


def graph_us(record, stream, reps: int = 50) -> float:
    """GPU µs per record() call, from a graph of `reps` back-to-back calls."""
    g = graphs.capture(lambda s: [record(s) for _ in range(reps)], stream)
    g.replay()
    start, end = cuda.event(), cuda.event()
    start.record(stream)
    g.replay()
    end.record(stream)
    end.synchronize()
    g.close()
    return cuda.event_elapsed_time(start, end) * 1e3 / reps


def profile(layers, b: Buffers, stream) -> dict[str, float]:
    """Per-op GPU time (µs) of the pieces of a token, each replayed alone."""
    gdn, attn = layers[0], layers[3]
    ops = {
        "gdn layer (no MoE)": lambda s: GDNLayer.__call__(_NoMoE(gdn), b, s),
        "attention layer (no MoE)": lambda s: AttnLayer.__call__(_NoMoE(attn), b, s),
        "MoE block": lambda s: gdn.moe(b, s),
        "delta_rule_step": lambda s: gated_delta.delta_rule_step(
            b.u, b.a.reshape(1, H_V), b.b.reshape(1, H_V), gdn.ssm_a, gdn.dt, gdn.state,
            b.state_slot, b.o, n_k_heads=H_K, head_map_mod=True, eps=EPS, stream=s),
        "conv_silu_step": lambda s: gated_delta.conv_silu_step(
            b.mixed.reshape(1, CONV), gdn.conv_w, gdn.conv_state, b.state_slot, b.u, stream=s),
        "add_rms_norm 2048": lambda s: norm.add_rms_norm(b.delta, b.h, gdn.norm, b.x.reshape(E),
                                                         EPS, stream=s),
        "quantize 2048": lambda s: qg.quantize_activations(b.x, b.act_e, stream=s),
        "router_topk 256→8": lambda s: moe.router_topk(b.router.reshape(1, N_EXPERTS), TOP_K,
                                                       b.ids, b.w, stream=s),
        "swiglu 8x512": lambda s: activation.swiglu(b.g, b.up, b.ffa, stream=s),
        "paged attention (ctx as set)": lambda s: attention.paged_decode_attention(
            b.qg, attn.k_cache, attn.v_cache, b.block_table, b.seq_len, b.attn, b.ws, stream=s),
        "sample greedy 248320": lambda s: sampling.sample(
            b.logits.reshape(1, N_VOCAB), b.temp, b.top_k, b.top_p, b.min_p, b.unif, b.token,
            b.sampling, stream=s),
    }
    return {name: graph_us(op, stream) for name, op in ops.items()}


class _NoMoE:
    """A layer's attributes with its MoE call turned into a no-op (to time the mixer alone)."""

    def __init__(self, layer):
        self.__dict__.update(layer.__dict__)
        self.moe = lambda b, s: None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ctx", type=int, nargs="+", default=[512, 32768])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    stream = cuda.stream()
    token, b, layers = build(max(args.ctx))
    token(stream)  # compile + warm
    stream.synchronize()
    t0 = time.perf_counter()
    token(stream)
    stream.synchronize()
    eager_ms = (time.perf_counter() - t0) * 1e3
    g = graphs.capture(token, stream)
    results = {"eager_ms_per_token": eager_ms, "by_ctx": []}
    for ctx in args.ctx:
        b.seq_len.copy_to_device(np.array([ctx], np.int32))
        b.pos.copy_to_device(np.array([ctx - 1], np.int32))
        b.slot.copy_to_device(np.array([ctx - 1], np.int32))
        g.replay()
        stream.synchronize()
        start, end = cuda.event(), cuda.event()
        n = 20
        t0 = time.perf_counter()
        start.record(stream)
        for _ in range(n):
            g.replay()
        end.record(stream)
        host_us = (time.perf_counter() - t0) / n * 1e6
        end.synchronize()
        ms = cuda.event_elapsed_time(start, end) / n
        results["by_ctx"].append({"ctx": ctx, "ms_per_token": ms, "tok_s": 1e3 / ms,
                                  "host_us_per_replay": host_us})
        print(f"ctx {ctx}: {ms:.3f} ms/token = {1e3 / ms:.0f} tok/s (graph replay host "
              f"{host_us:.0f} us); eager {eager_ms:.1f} ms/token", flush=True)
    results["profile_us"] = profile(layers, b, stream)
    for name, us in results["profile_us"].items():
        print(f"  {name:30s} {us:8.2f} us", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
