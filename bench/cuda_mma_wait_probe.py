"""What the grouped (MoE) tensor-core GEMM waits on: its time with real loads, with the weight
pieces replaced by constants (no weight loads or dequantization), with the 16-byte loads
replaced (no activation loads, nor Q4_K's code bytes), and with neither.

    PYTHONPATH=. python bench/cuda_mma_wait_probe.py        (repo root, on the GPU)

Qwen3.6-35B-A3B expert shapes (256 experts, top-8, Q4_K), tile 64 tokens, 64 / 512 / 4096 tokens.
"""
import sys
import numpy as np
from numba import cuda, uint32
sys.path.insert(0, "bench")
import cuda_mma_bench as B
from sparkinfer_cli.ggml_types import GGMLType
from sparkinfer_cli.kernels.cuda import mma_gemm as mg
from sparkinfer_cli.kernels.cuda.jit import device_function
from sparkinfer_cli.kernels.cuda.expert_route import ExpertRoute, route_experts

real_piece = mg._PIECES[GGMLType.Q4_K]
real_ld = mg.ld_v4_u32

@device_function(numba_inline=True)
def fake_piece(w, off, kk):
    v = uint32(0x3C003C00) ^ uint32(kk)
    return (v, v, v, v, v, v, v, v)

@device_function(numba_inline=True)
def fake_ld(x, off):
    v = uint32(0x3F800000) ^ uint32(off & 0xFF)
    return (v, v, v, v)

rng = np.random.default_rng(0)
t = GGMLType.Q4_K
gate, up = (B.random_matrix(t, 256, 512, 2048, rng) for _ in range(2))
down = B.random_matrix(t, 256, 2048, 512, rng)
for name, piece, ld in (("base", real_piece, real_ld), ("no-w", fake_piece, real_ld),
                        ("no-x", real_piece, fake_ld), ("none", fake_piece, fake_ld)):
    mg._PIECES[t] = piece
    mg.ld_v4_u32 = ld
    for f in (mg._stage_fns, mg._gemm_kernel):
        f.cache_clear()
    for n_tok in (64, 512, 4096):
        n_slots = n_tok * 8
        ids = np.argsort(rng.random((n_tok, 256)), axis=1)[:, :8].astype(np.int32).ravel()
        route = ExpertRoute(256, n_slots, 64)
        route_experts(cuda.to_device(ids), n_slots, route)
        slot_x = cuda.to_device(np.repeat(np.arange(n_tok, dtype=np.int32), 8))
        x = cuda.to_device(rng.standard_normal((n_tok, 2048), np.float32))
        h = cuda.device_array((n_slots, 512), np.float32)
        us1 = B.gpu_us(lambda: mg.grouped_matmul(gate, x, h, route, slot_x, up=up), 20)
        slot_h = cuda.to_device(np.arange(n_slots, dtype=np.int32))
        y = cuda.device_array((n_slots, 2048), np.float32)
        us2 = B.gpu_us(lambda: mg.grouped_matmul(down, h, y, route, slot_h), 20)
        print(f"{name} tok {n_tok}: gate+up {us1:7.1f} µs, down {us2:7.1f} µs", flush=True)
