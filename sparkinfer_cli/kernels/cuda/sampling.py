"""Token sampling on the GPU, so only token ids come back to the host.

temperature ≤ 0 or top_k == 1 → greedy argmax (ties → lowest id). Otherwise the top
k = min(top_k or MAX_CANDIDATES, MAX_CANDIDATES) logits are candidates (by value, ties → lower id),
and top-p and min-p trim them by the host Sampler's rules (engine/sampler.py: top-p at temperature
1, min-p against the best logit); the host-supplied uniform u ∈ [0, 1) then draws from
softmax(kept / T) walking the kept ids in ascending order, as the host's cumulative search does.
For 1 ≤ top_k ≤ MAX_CANDIDATES this is exactly the host's choice (`supports_exactly`); a wider
top-k would need candidates this kernel does not keep. A structured answer's grammar masks the
vocabulary first: `allowed` holds a bit per token (bit j of word w: token 32w + j), tokens whose
bit is clear are never candidates. Two kernels:
  1. grid (n_chunks, n_seqs): each block finds the k best of its vocabulary chunk by k rounds of
     "block argmax strictly below the previous pick";
  2. grid (n_seqs,): the same over the n_chunks·k candidates, then the cut and the draw.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int32

from sparkinfer_cli.kernels.cuda.runtime.intrinsics import IS_SIMULATOR, chain_start
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv, check_array
from sparkinfer_cli.kernels.cuda.runtime.warp import shfl_xor

MAX_CANDIDATES = 64
THREADS = 32 if IS_SIMULATOR else 256  # kernels are blockDim-generic; the simulator is slow
CHUNK = 128 if IS_SIMULATOR else 2048  # vocabulary entries per stage-1 block


# precise: candidates rank against ±inf sentinels (fastmath assumes no infinities)
@device_function(fastmath=False)
def _before(v, i, best_v, best_i):
    return v > best_v or (v == best_v and i < best_i)


@device_function(fastmath=False)
def _block_best_below(vals, ids, base, n, id_offset, prev_v, prev_i, sm_v, sm_i, allowed,
                      allowed_at):
    """Best (value, id) among vals[base:base+n] ranking strictly after (prev_v, prev_i).

    id of entry t is ids[base + t] when ids is non-empty, else id_offset + t. When allowed is
    non-empty, only ids whose bit is set in allowed[allowed_at:] take part. All threads get it.
    """
    best_v, best_i = float32(-math.inf), int32(2147483647)
    for t in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        v = vals[base + t]
        i = ids[base + t] if ids.size > 0 else int32(id_offset + t)
        if allowed.size > 0 and (allowed[allowed_at + (i >> 5)] >> (i & 31)) & 1 == 0:
            continue
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


@kernel
def _chunk_topk_kernel(logits, n_vocab, chunk, no_ids, temperature, top_k, allowed, cand_v,
                       cand_i):
    chain_start()
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
                                               prev_v, prev_i, sm_v, sm_i, allowed,
                                               seq * mask_words(n_vocab))
        if cuda.threadIdx.x == 0:
            cand_v[out + r] = prev_v if r < k else float32(-math.inf)
            cand_i[out + r] = prev_i if r < k else int32(2147483647)


@device_function(fastmath=False)
def _kept_count(best_v, k, top_p, min_p):
    """How many of the k best (value-sorted) candidates survive top-p and min-p, by the host
    Sampler's rules (engine/sampler.py): top-p at temperature 1 over the k candidates (the one
    that crosses top_p is kept), then min-p against the best value."""
    kept = k
    if top_p < 1.0:
        total = float64(0.0)
        for r in range(k):
            total += float64(math.exp(best_v[r] - best_v[0]))
        target, cdf = float64(top_p) * total, float64(0.0)
        for r in range(k):
            cdf += float64(math.exp(best_v[r] - best_v[0]))
            if cdf >= target:
                kept = r + 1
                break
    if min_p > 0.0:
        floor = best_v[0] + float32(math.log(min_p))
        n = 1
        while n < kept and best_v[n] >= floor:
            n += 1
        kept = n
    return kept


@device_function(fastmath=False)
def _draw_in_id_order(best_v, best_i, kept, temperature, u):
    """The id drawn with weights exp((v - best) / T) over the kept candidates taken in id order
    (as the host's cumulative search walks the vocabulary): the first whose cumulative weight
    exceeds u · total."""
    top = best_v[0]
    for r in range(1, kept):  # insertion sort of the kept candidates by id
        v, i, j = best_v[r], best_i[r], r
        while j > 0 and best_i[j - 1] > i:
            best_v[j], best_i[j] = best_v[j - 1], best_i[j - 1]
            j -= 1
        best_v[j], best_i[j] = v, i
    total = float64(0.0)
    for r in range(kept):
        best_v[r] = math.exp((best_v[r] - top) / temperature)
        total += float64(best_v[r])
    target, cdf = float64(u) * total, float64(0.0)
    for r in range(kept):
        cdf += float64(best_v[r])
        if cdf > target:
            return best_i[r]
    return best_i[kept - 1]


@kernel
def _final_kernel(cand_v, cand_i, n_cand, temperature, top_k, top_p, min_p, uniform, out_ids):
    chain_start()
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
                                           sm_v, sm_i, cand_i[:0], 0)  # stage 1 masked them
        if cuda.threadIdx.x == 0:
            best_v[r], best_i[r] = prev_v, prev_i
    if cuda.threadIdx.x == 0:
        if k == 1:
            out_ids[seq] = best_i[0]
        else:
            kept = _kept_count(best_v, k, top_p[seq], min_p[seq])
            out_ids[seq] = _draw_in_id_order(best_v, best_i, kept, temp, uniform[seq])


@device_function
def mask_words(n_vocab):
    """u32 words of one sequence's mask of allowed tokens."""
    return (n_vocab + 31) // 32


def supports_exactly(temperature: float, top_k: int) -> bool:
    """Whether `sample` picks what the host Sampler would (given the same u): greedy, or a top-k
    within the candidates this kernel keeps."""
    return temperature <= 0 or 1 <= top_k <= MAX_CANDIDATES


class SamplingWorkspace:
    """Stage-1 candidates for up to n_seqs sequences over a vocabulary of n_vocab."""

    def __init__(self, n_seqs: int, n_vocab: int):
        self.n_chunks = cdiv(n_vocab, CHUNK)
        n = n_seqs * self.n_chunks * MAX_CANDIDATES
        self.cand_v = cuda.device_array(n, np.float32)  # (n_seqs, n_chunks, MAX_CANDIDATES)
        self.cand_i = cuda.device_array(n, np.int32)
        self.no_ids = cuda.device_array(0, np.int32)
        self.no_mask = cuda.device_array(0, np.uint32)


def sample(logits, temperature, top_k, top_p, min_p, uniform, out_ids, ws: SamplingWorkspace,
           stream=0, allowed=None) -> None:
    """logits (n_seqs, n_vocab) f32; per-sequence float32 temperature/top_p/min_p/uniform, int32
    top_k (0 = MAX_CANDIDATES) → out_ids int32 (n_seqs,). Logits should already carry penalties.
    allowed: uint32 (n_seqs, mask_words(n_vocab)), a bit per token that may be picked (each row
    must allow one); None: every token."""
    n_seqs, n_vocab = logits.shape
    if allowed is None:
        allowed = ws.no_mask
    else:
        check_array("allowed", allowed, np.uint32, (n_seqs, cdiv(n_vocab, 32)))
    check_array("logits", logits, np.float32)
    for name, arr, dtype in (("temperature", temperature, np.float32), ("top_k", top_k, np.int32),
                             ("top_p", top_p, np.float32), ("min_p", min_p, np.float32),
                             ("uniform", uniform, np.float32), ("out_ids", out_ids, np.int32)):
        check_array(name, arr, dtype, (n_seqs,))
    n_cand = n_seqs * ws.n_chunks * MAX_CANDIDATES
    if cdiv(n_vocab, CHUNK) != ws.n_chunks or ws.cand_v.size < n_cand:
        raise ValueError("sampling workspace was sized for another vocabulary or batch")
    _chunk_topk_kernel[(ws.n_chunks, n_seqs), THREADS, stream](
        logits.reshape(logits.size), n_vocab, CHUNK, ws.no_ids, temperature, top_k,
        allowed.reshape(allowed.size), ws.cand_v, ws.cand_i)
    _final_kernel[n_seqs, THREADS, stream](
        ws.cand_v, ws.cand_i, ws.n_chunks * MAX_CANDIDATES, temperature, top_k, top_p, min_p,
        uniform, out_ids)
