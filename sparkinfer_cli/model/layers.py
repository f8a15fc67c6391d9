"""Building blocks of every model: quantized linear, embedding, RMSNorm, attention, SwiGLU FFN.

Quantization is a layer: a Linear computes with its GGUF tensor's own block format, so model code
never branches on ggml types.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from sparkinfer_cli.kernels.cpu import decode_ops, paged_attention
from sparkinfer_cli.kernels.cpu.llvm_jit import has_avx2
from sparkinfer_cli.kernels.cpu.packed_matvec import PackedMatvec
from sparkinfer_cli.kernels.cpu.quant import embedding_rows, matmul, matmul_row_invariant
from sparkinfer_cli.kernels.cpu.quant_packed import PackedWeight, can_pack, pack
from sparkinfer_cli.kernels.cpu.swiglu import swiglu
from sparkinfer_cli.model.batch import SequenceSpan
from sparkinfer_cli.model.cache import ModelCache
from sparkinfer_cli.model.config import ModelConfig
from sparkinfer_cli.model.tensors import AttentionTensors, SwiGLUTensors
from sparkinfer_cli.model.weights import QTensor


class Linear:
    """y = x · Wᵀ (+ b) with W in its GGUF encoding. x: (T, in) → (T, out)."""

    def __init__(self, weight: QTensor, bias: QTensor | None = None):
        self.weight = weight
        self.bias = bias.as_f32() if bias is not None else None
        self.packed: PackedWeight | None = None  # compact copy for the int8 decode kernel
        self.decode: PackedMatvec | None = None
        self.row_invariant = False  # every output row computed the same way whatever the rows

    @property
    def is_packable(self) -> bool:
        w = self.weight
        return can_pack(w.ggml_type, w.ne0) and w.raw.ndim == 2 and has_avx2()

    def use_int8_decode(self, packed: PackedWeight | None = None) -> None:
        """Every call quantizes x to int8 blocks (llama.cpp's numerics) and runs the packed-weight
        AVX2 kernel: several times faster than the float dequant·dot at decode, and no slower
        than dequantized tiles through BLAS for prompts (2 cores, 128 and 512 tokens). One kernel
        for every pass size keeps a sequence's numbers independent of what shares its pass, and
        weights the kernel cannot pack (F32 routers, odd shapes) go through a row-invariant
        product for the same reason. `packed`: this weight's records packed earlier (on disk)."""
        w = self.weight
        self.row_invariant = True
        if self.is_packable:
            self.packed = packed or pack(w.raw, w.ggml_type, w.ne0)
            self.decode = PackedMatvec([self.packed], [self.bias])

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        w, x = self.weight, np.ascontiguousarray(x, dtype=np.float32)
        if self.decode is not None:
            return self.decode(x)
        product = matmul_row_invariant if self.row_invariant else matmul
        y = product(w.raw, w.ggml_type, w.ne0, x)
        return y + self.bias if self.bias is not None else y


def fuse_decode(linears: list[Linear]) -> PackedMatvec | None:
    """One decode call for linears that read the same x (all switched to int8 decode)."""
    packed = [lin.packed for lin in linears]
    if any(p is None for p in packed):
        return None
    return PackedMatvec([p for p in packed if p is not None], [lin.bias for lin in linears])


class Embedding:
    def __init__(self, weight: QTensor):
        self.weight = weight

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        w = self.weight
        return embedding_rows(w.raw, w.ggml_type, w.ne0, ids)  # (T, n_embd)


class RMSNorm:
    def __init__(self, weight: QTensor, eps: float):
        self.weight, self.eps = weight.as_f32(), eps

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Row by row whatever the pass size: a row's result never depends on the others."""
        return decode_ops.rms_norm(np.asarray(x, dtype=np.float32), self.weight, self.eps)


@dataclass(frozen=True)
class Forward:
    """What every layer needs to know about the current pass besides its input."""
    positions: np.ndarray  # (N,) absolute position of each new token
    spans: list[SequenceSpan]
    cache: ModelCache

    @cached_property
    def attention_rows(self) -> paged_attention.PassRows:
        """Where each new token attends (shared by every attention layer of the pass)."""
        tables = [s.block_table for s in self.spans for _ in range(s.hi - s.lo)]
        return paged_attention.PassRows(tables, self.positions, self.cache.block_size)


class Attention:
    """GQA softmax attention over the paged KV cache (llama / qwen2 / qwen3 / qwen3moe).

    Optional per arch: q/k/v biases (qwen2), per-head q/k RMSNorm before RoPE (qwen3*).
    """

    def __init__(self, t: AttentionTensors, cfg: ModelConfig, layer: int):
        self.attn_q = Linear(t.q, t.q_bias)
        self.attn_k = Linear(t.k, t.k_bias)
        self.attn_v = Linear(t.v, t.v_bias)
        self.attn_output = Linear(t.output)
        self.attn_q_norm = RMSNorm(t.q_norm, cfg.rms_eps) if t.q_norm is not None else None
        self.attn_k_norm = RMSNorm(t.k_norm, cfg.rms_eps) if t.k_norm is not None else None
        self.layer, self.cfg = layer, cfg
        self.qkv_decode: PackedMatvec | None = None

    def fuse_int8_decode(self) -> None:
        self.qkv_decode = fuse_decode([self.attn_q, self.attn_k, self.attn_v])

    def project_qkv(self, x: np.ndarray, fwd: Forward) -> tuple[np.ndarray, ...]:
        """Normalised, rotated q (N, H, D) and k, v (N, H_kv, D)."""
        cfg, N = self.cfg, len(x)
        if self.qkv_decode is not None:
            q, k, v = self.qkv_decode.split(self.qkv_decode(x))
        else:
            q, k, v = self.attn_q(x), self.attn_k(x), self.attn_v(x)
        q = q.reshape(N, cfg.n_head, cfg.head_dim)
        k = k.reshape(N, cfg.n_head_kv, cfg.head_dim)
        v = v.reshape(N, cfg.n_head_kv, cfg.head_dim)
        if self.attn_q_norm is not None and self.attn_k_norm is not None:
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        q = decode_ops.rope(q, fwd.positions, cfg.n_rot, cfg.rope_base, cfg.rope_style)
        k = decode_ops.rope(k, fwd.positions, cfg.n_rot, cfg.rope_base, cfg.rope_style)
        return q, k, v

    def attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, fwd: Forward) -> np.ndarray:
        """Write k, v into each sequence's cache, attend, return (N, H·D). Every token attends
        on its own through the one row kernel, over exactly the keys before it, so its numbers
        are those of one-at-a-time decoding whatever piece of its prompt it came in: the step
        budget cuts prompts where the server's load puts the cut, and a prefix-cache hit starts
        them at a block, so a kernel chosen by the piece (a BLAS product over the piece's rows
        and keys sums by its shape) made greedy answers depend on the load. On 2 cores the row
        kernel also prefills a 512- or 2,048-token prompt faster than that product did."""
        cache = fwd.cache
        out = paged_attention.attend(q, k, v, cache.k, cache.v, cache.attn_index[self.layer],
                                     fwd.attention_rows)
        return out.reshape(len(q), -1)

    def __call__(self, x: np.ndarray, fwd: Forward) -> np.ndarray:
        q, k, v = self.project_qkv(x, fwd)
        return self.attn_output(self.attend(q, k, v, fwd))


class SwiGLU:
    """down(silu(gate(x)) ⊙ up(x))."""

    def __init__(self, t: SwiGLUTensors):
        self.ffn_gate, self.ffn_up, self.ffn_down = Linear(t.gate), Linear(t.up), Linear(t.down)
        self.gate_up_decode: PackedMatvec | None = None

    def fuse_int8_decode(self) -> None:
        self.gate_up_decode = fuse_decode([self.ffn_gate, self.ffn_up])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.gate_up_decode is not None:
            gate, up = self.gate_up_decode.split(self.gate_up_decode(x))
        else:
            gate, up = self.ffn_gate(x), self.ffn_up(x)
        return self.ffn_down(swiglu(gate, up))
