"""Token sampling on the GPU, so only token ids come back to the host.

temperature ≤ 0 or top_k == 1 → greedy argmax (ties → lowest id). Otherwise the top
k = min(top_k or MAX_CANDIDATES, MAX_CANDIDATES) logits are kept, top-p and min-p trim them and the
host-supplied uniform u ∈ [0, 1) picks one of softmax(candidates / T). Two kernels:
  1. grid (n_chunks, n_seqs): each block finds the k best of its vocabulary chunk by k rounds of
     "block argmax strictly below the previous pick";
  2. grid (n_seqs,): the same over the n_chunks·k candidates, then the draw.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32

from sparkinfer_cli.kernels.cuda.intrinsics import IS_SIMULATOR
from sparkinfer_cli.kernels.cuda.jit import device_function
from sparkinfer_cli.kernels.cuda.launch import cdiv, check_array
from sparkinfer_cli.kernels.cuda.warp import shfl_xor

MAX_CANDIDATES = 64
THREADS = 32 if IS_SIMULATOR else 256  # kernels are blockDim-generic; the simulator is slow
CHUNK = 128 if IS_SIMULATOR else 2048  # vocabulary entries per stage-1 block


# precise: candidates rank against ±inf sentinels (fastmath assumes no infinities)
@device_function(fastmath=False)
def _before(v, i, best_v, best_i):
    return v > best_v or (v == best_v and i < best_i)


@device_function(fastmath=False)
def _block_best_below(vals, ids, base, n, id_offset, prev_v, prev_i, sm_v, sm_i):
    """Best (value, id) among vals[base:base+n] ranking strictly after (prev_v, prev_i).

    id of entry t is ids[base + t] when ids is non-empty, else id_offset + t. All threads get it.
    """
    best_v, best_i = float32(-math.inf), int32(2147483647)
    for t in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        v = vals[base + t]
        i = ids[base + t] if ids.size > 0 else int32(id_offset + t)
        if _before(prev_v, prev_i, v, i) and _before(v, i, best_v, best_i):
            best_v, best_i = v, i
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


@device_function(fastmath=False)
def _n_candidates(temperature, top_k):
    k = min(top_k, MAX_CANDIDATES) if top_k > 0 else MAX_CANDIDATES
    return 1 if temperature <= 0.0 else k


@cuda.jit
def _chunk_topk_kernel(logits, n_vocab, chunk, no_ids, temperature, top_k, cand_v, cand_i):
    # candidates (n_seqs, n_chunks, MAX_CANDIDATES); slots past k stay -inf
    c, seq = cuda.blockIdx.x, cuda.blockIdx.y
    sm_v = cuda.shared.array(32, float32)
    sm_i = cuda.shared.array(32, int32)
    start = c * chunk
    n = min(chunk, n_vocab - start)
    out = (seq * cuda.gridDim.x + c) * MAX_CANDIDATES
    prev_v, prev_i = float32(math.inf), int32(-1)
    k = _n_candidates(temperature[seq], top_k[seq])
    for r in range(MAX_CANDIDATES):
        if r < k:
            prev_v, prev_i = _block_best_below(logits, no_ids, seq * n_vocab + start, n, start,
                                               prev_v, prev_i, sm_v, sm_i)
        if cuda.threadIdx.x == 0:
            cand_v[out + r] = prev_v if r < k else float32(-math.inf)
            cand_i[out + r] = prev_i if r < k else int32(2147483647)


@cuda.jit(fastmath=True)
def _final_kernel(cand_v, cand_i, n_cand, temperature, top_k, top_p, min_p, uniform, out_ids):
    seq = cuda.blockIdx.x
    sm_v = cuda.shared.array(32, float32)
    sm_i = cuda.shared.array(32, int32)
    best_v = cuda.shared.array(MAX_CANDIDATES, float32)
    best_i = cuda.shared.array(MAX_CANDIDATES, int32)
    temp = temperature[seq]
    k = _n_candidates(temp, top_k[seq])
    prev_v, prev_i = float32(math.inf), int32(-1)
    for r in range(k):
        prev_v, prev_i = _block_best_below(cand_v, cand_i, seq * n_cand, n_cand, 0, prev_v, prev_i,
                                           sm_v, sm_i)
        if cuda.threadIdx.x == 0:
            best_v[r], best_i[r] = prev_v, prev_i
    if cuda.threadIdx.x != 0:
        return
    # softmax over the sorted candidates, cut by top-p mass and min-p ratio, then draw
    total, v_max = float32(0.0), best_v[0]
    for r in range(k):
        best_v[r] = math.exp((best_v[r] - v_max) / max(temp, float32(1e-6)))
        total += best_v[r]
    kept, mass = 0, float32(0.0)
    for r in range(k):
        if r > 0 and (mass >= top_p[seq] * total or best_v[r] < min_p[seq]):
            break
        mass += best_v[r]
        kept = r + 1
    target = uniform[seq] * mass
    pick = kept - 1
    acc = float32(0.0)
    for r in range(kept):
        acc += best_v[r]
        if target < acc:
            pick = r
            break
    out_ids[seq] = best_i[pick]


class SamplingWorkspace:
    """Stage-1 candidates for up to n_seqs sequences over a vocabulary of n_vocab."""

    def __init__(self, n_seqs: int, n_vocab: int):
        self.n_chunks = cdiv(n_vocab, CHUNK)
        n = n_seqs * self.n_chunks * MAX_CANDIDATES
        self.cand_v = cuda.device_array(n, np.float32)  # (n_seqs, n_chunks, MAX_CANDIDATES)
        self.cand_i = cuda.device_array(n, np.int32)
        self.no_ids = cuda.device_array(0, np.int32)


def sample(logits, temperature, top_k, top_p, min_p, uniform, out_ids, ws: SamplingWorkspace,
           stream=0) -> None:
    """logits (n_seqs, n_vocab) f32; per-sequence float32 temperature/top_p/min_p/uniform, int32
    top_k (0 = MAX_CANDIDATES) → out_ids int32 (n_seqs,). Logits should already carry penalties."""
    n_seqs, n_vocab = logits.shape
    check_array("logits", logits, np.float32)
    for name, arr, dtype in (("temperature", temperature, np.float32), ("top_k", top_k, np.int32),
                             ("top_p", top_p, np.float32), ("min_p", min_p, np.float32),
                             ("uniform", uniform, np.float32), ("out_ids", out_ids, np.int32)):
        check_array(name, arr, dtype, (n_seqs,))
    n_cand = n_seqs * ws.n_chunks * MAX_CANDIDATES
    if cdiv(n_vocab, CHUNK) != ws.n_chunks or ws.cand_v.size < n_cand:
        raise ValueError("sampling workspace was sized for another vocabulary or batch")
    _chunk_topk_kernel[(ws.n_chunks, n_seqs), THREADS, stream](
        logits.reshape(logits.size), n_vocab, CHUNK, ws.no_ids, temperature, top_k, ws.cand_v,
        ws.cand_i)
    _final_kernel[n_seqs, THREADS, stream](
        ws.cand_v, ws.cand_i, ws.n_chunks * MAX_CANDIDATES, temperature, top_k, top_p, min_p,
        uniform, out_ids)


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
