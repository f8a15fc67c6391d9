"""Token sampling on the GPU, one block per sequence, so only token ids come back to the host.

temperature ≤ 0 or top_k == 1 → greedy argmax (ties → lowest id). Otherwise the top min(top_k,
MAX_CANDIDATES) logits are found by repeated block-argmax below the previous pick, then top-p and
min-p trim them and the host-supplied uniform u ∈ [0, 1) picks one of softmax(candidates / T).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32

from sparkinfer_cli.kernels.cuda.intrinsics import IS_SIMULATOR
from sparkinfer_cli.kernels.cuda.launch import check_array
from sparkinfer_cli.kernels.cuda.warp import shfl_xor

MAX_CANDIDATES = 64
THREADS = 32 if IS_SIMULATOR else 256  # kernels are blockDim-generic; the simulator is slow


@cuda.jit(device=True, inline=True)
def _before(v, i, best_v, best_i):
    return v > best_v or (v == best_v and i < best_i)


@cuda.jit(device=True, inline=True)
def _block_argmax_below(logits, base, n_vocab, prev_v, prev_i, sm_v, sm_i):
    """Best (value, id) of the row ranking strictly after (prev_v, prev_i); all threads get it."""
    best_v, best_i = float32(-math.inf), int32(n_vocab)
    for t in range(cuda.threadIdx.x, n_vocab, cuda.blockDim.x):
        v = logits[base + t]
        if _before(prev_v, prev_i, v, t) and _before(v, t, best_v, best_i):
            best_v, best_i = v, int32(t)
    for offset in (16, 8, 4, 2, 1):
        ov, oi = shfl_xor(best_v, offset), shfl_xor(best_i, offset)
        if _before(ov, oi, best_v, best_i):
            best_v, best_i = ov, oi
    warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
    if lane == 0:
        sm_v[warp], sm_i[warp] = best_v, best_i
    cuda.syncthreads()
    best_v, best_i = sm_v[0], sm_i[0]
    for w in range(1, cuda.blockDim.x // 32):
        if _before(sm_v[w], sm_i[w], best_v, best_i):
            best_v, best_i = sm_v[w], sm_i[w]
    cuda.syncthreads()
    return best_v, best_i


@cuda.jit(fastmath=True)
def _sample_kernel(logits, n_vocab, temperature, top_k, top_p, min_p, uniform, out_ids):
    seq = cuda.blockIdx.x
    sm_v = cuda.shared.array(32, float32)
    sm_i = cuda.shared.array(32, int32)
    cand_v = cuda.shared.array(MAX_CANDIDATES, float32)
    cand_i = cuda.shared.array(MAX_CANDIDATES, int32)
    temp = temperature[seq]
    k = min(top_k[seq], MAX_CANDIDATES) if top_k[seq] > 0 else MAX_CANDIDATES
    k = 1 if temp <= 0.0 else min(k, n_vocab)
    prev_v, prev_i = float32(math.inf), int32(-1)
    for r in range(k):
        prev_v, prev_i = _block_argmax_below(logits, seq * n_vocab, n_vocab, prev_v, prev_i,
                                             sm_v, sm_i)
        if cuda.threadIdx.x == 0:
            cand_v[r], cand_i[r] = prev_v, prev_i
    if cuda.threadIdx.x != 0:
        return
    # softmax over candidates (sorted descending), cut by top-p mass and min-p ratio, then draw
    total, v_max = float32(0.0), cand_v[0]
    for r in range(k):
        cand_v[r] = math.exp((cand_v[r] - v_max) / max(temp, float32(1e-6)))
        total += cand_v[r]
    kept, mass = 0, float32(0.0)
    for r in range(k):
        if r > 0 and (mass >= top_p[seq] * total or cand_v[r] < min_p[seq]):
            break
        mass += cand_v[r]
        kept = r + 1
    target = uniform[seq] * mass
    pick = kept - 1
    acc = float32(0.0)
    for r in range(kept):
        acc += cand_v[r]
        if target < acc:
            pick = r
            break
    out_ids[seq] = cand_i[pick]


def sample(logits, temperature, top_k, top_p, min_p, uniform, out_ids, stream=0) -> None:
    """logits (n_seqs, n_vocab) f32; per-sequence float32 temperature/top_p/min_p/uniform, int32
    top_k (0 = MAX_CANDIDATES) → out_ids int32 (n_seqs,). Logits should already carry penalties."""
    n_seqs, n_vocab = logits.shape
    check_array("logits", logits, np.float32)
    for name, arr, dtype in (("temperature", temperature, np.float32), ("top_k", top_k, np.int32),
                             ("top_p", top_p, np.float32), ("min_p", min_p, np.float32),
                             ("uniform", uniform, np.float32), ("out_ids", out_ids, np.int32)):
        check_array(name, arr, dtype, (n_seqs,))
    _sample_kernel[n_seqs, THREADS, stream](logits.reshape(logits.size), n_vocab, temperature,
                                            top_k, top_p, min_p, uniform, out_ids)


def sample_reference(logits, temperature, top_k, top_p, min_p, uniform) -> np.ndarray:
    out = np.zeros(len(logits), np.int32)
    for s, row in enumerate(logits.astype(np.float64)):
        order = np.argsort(-row, kind="stable")
        if temperature[s] <= 0:
            out[s] = order[0]
            continue
        k = min(top_k[s] if top_k[s] > 0 else MAX_CANDIDATES, MAX_CANDIDATES, len(row))
        p = np.exp((row[order[:k]] - row[order[0]]) / temperature[s])
        kept = next((r for r in range(1, k) if p[:r].sum() >= top_p[s] * p.sum()
                     or p[r] < min_p[s]), k)
        cdf = np.cumsum(p[:kept])
        out[s] = order[min(np.searchsorted(cdf, uniform[s] * cdf[-1], side="right"), kept - 1)]
    return out
