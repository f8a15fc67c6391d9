"""MoE prefill GEMM for K-quant expert weights (Q4_K, Q5_K) on int8 tensor cores, over q8
activations.

y[slot, r] = Σ_j (d·sc_j[r]) · dx[t, j] · Σ_{i<32} q[r, 32j + i] · qx[t, 32j + i]
             − (dmin·m_j[r]) · xs[t, j]                         (t = slot_x[slot])

q: a row's unsigned 4/5-bit codes of sub-block j (32 elements), sc_j / m_j its 6-bit scale and
min, d / dmin the super-block's f16 scales; qx, dx, xs: the activations quantized per 32 elements
(quant_gemv.QuantizedActivations, xs = dx·Σqx, which carries the min term). The codes times the
q8 values are one mma.sync m16n8k32 (s8·s8 → s32) a sub-block, scaled into float32 accumulators
(llama.cpp's MMQ). mma_gemm and fragment_gemm instead turn each weight into an f16 and the
activations into f16 tiles. Opt-in (SPARKINFER_INT8_EXPERTS): on the H200 it has not yet beaten
them (bench/results/2026-12-05-int8-experts.md): the float scale and min terms of each
sub-block, per n8 tile, cost more instructions a k step than the mma.

- A block: BM = 64 staged weight rows × BN = 64 slots of one route tile (mma_gemm's ExpertRoute:
  every slot of a tile uses one expert); 8 warps of 16 rows × 32 slots (4 n8 tiles). A warp
  multiplies only the 16-slot groups that hold slots of the tile, so the small tiles of a mixed
  serving step cost little beyond their staging.
- Pipeline steps of half a super-block (STEP_K = 128 elements, SUBS = 4 sub-blocks): each
  thread loads 16 code bytes of one staged row (and, for Q5_K, the 16 bytes of their 5th bits)
  plus the row's 16-byte super-block header, and the tokens' q8 bytes; the next step's loads go
  out before the warps multiply this one. Staging unpacks the codes into int8 rows in shared
  memory (a nibble mask, and the 5th bit or'ed in: 2-4 instructions per 4 weights, once a block)
  and decodes each (row, sub-block)'s d·sc and dmin·m, so the warps read A fragments with one
  ldmatrix and their scales as floats.
- Fused SwiGLU (`up=`): each warp's 16 staged rows are 8 gate rows and the same 8 rows of `up`,
  so a lane holds the gate and up sums of one output in its C elements e and e + 2.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int64, uint32

from sparkinfer_cli.gguf.ggml_types import GGMLType
from sparkinfer_cli.kernels.cuda.ggml_blocks import M1, M4, f16, scale_min_k4
from sparkinfer_cli.kernels.cuda.mma_fragments import (
    block_tile,
    gemm_epilogue,
    mma_s8_biased,
    scaled_sum,
    sum_offset,
)
from sparkinfer_cli.kernels.cuda.mma_gemm import output_parts
from sparkinfer_cli.kernels.cuda.quant_gemv import (
    DeviceQuantMatrix,
    QuantizedActivations,
    store_part,
)
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import (
    IS_SIMULATOR,
    LDMATRIX_ALIGN,
    chain_start,
    ld_v4_u32,
    ldmatrix_x4_b8,
    ldmatrix_x4_b8_pairs,
)
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv, check_array

BM = 64  # staged weight rows a block
BN = 64  # slots a block (one route tile)
THREADS = 256  # 8 warps: 4 of 16 rows × 2 of 32 slots; 4 threads stage each weight row
WARP_TOKENS = 32
SUBS = 4  # 32-element sub-blocks a pipeline step: half a super-block
STEP_K = 32 * SUBS
# bytes between staged rows (128 int8): 144 = 36 words, so the 8 rows of an ldmatrix start in
# distinct banks
TILE_STRIDE = 144
ROW_WORDS = TILE_STRIDE // 4
TILE_WORDS = BM * ROW_WORDS  # one buffer of a tile (BM == BN)
X_LOADS = BN * STEP_K // 16 // THREADS  # 16-byte q8 words a thread loads a step
SCALES = 2 * SUBS * BM  # floats of one buffer's (scale, min) or (dx, xs) planes (BM == BN)
# two blocks an SM (≤ 128 registers a thread); the simulator takes no launch bounds
_LAUNCH_BOUNDS = {} if IS_SIMULATOR else {"launch_bounds": (THREADS, 2)}
# (super-block bytes, offset of its 4-bit codes) of each type this GEMM takes; both start with
# d, dmin (f16) and the 12 bytes of 6-bit scales and mins; Q5_K's 5th bits follow at byte 16
_LAYOUTS = {GGMLType.Q4_K: (144, 16), GGMLType.Q5_K: (176, 48)}


def supports(w: DeviceQuantMatrix) -> bool:
    """Whether this GEMM takes W: a Q4_K or Q5_K matrix (k is a whole number of super-blocks)."""
    return w.ggml_type in _LAYOUTS


# ---------------------------------------------------------------- staging
@functools.cache
def _stage_fns(ggml_type: GGMLType):
    """(fetch, put): a step's global loads into registers, then from them into shared memory."""
    block_bytes, codes_at = _LAYOUTS[ggml_type]
    five_bits = ggml_type == GGMLType.Q5_K

    @device_function(numba_inline=True)
    def fetch(c, w, w_off, xq, xd, xs, k, x_rows, wv, xv, dv):
        """Step c's words. wv: this thread's 16 code bytes (piece p = tid % 4 of its row's 64 a
        step), its row's super-block header, for Q5_K the 5th bits of those 16 elements; xv: two
        16-byte q8 words of slots x_rows[0], x_rows[1]; dv: (dx, xs) of x_rows[2]'s sub-block."""
        tid = cuda.threadIdx.x
        p = tid & 3
        at = w_off + (c >> 1) * block_bytes
        q = ld_v4_u32(w, at + codes_at + 64 * (c & 1) + 16 * p)
        head = ld_v4_u32(w, at)
        for e in range(4):
            wv[e] = q[e]
            wv[4 + e] = head[e]
        if five_bits:  # qh byte i holds bit j of element i of sub-block j
            qh = ld_v4_u32(w, at + 16 + 16 * (p & 1))
            for e in range(4):
                wv[8 + e] = qh[e]
        for i in range(X_LOADS):
            v = ld_v4_u32(xq, x_rows[i] * k + c * STEP_K + 16 * (tid & 7))
            for e in range(4):
                xv[4 * i + e] = v[e]
        blk = x_rows[2] * (k // 32) + c * SUBS + (tid & 3)
        dv[0] = xd[blk]
        dv[1] = xs[blk]

    @device_function(numba_inline=True)
    def put(c, buf, sa, sb, sw, sx, wv, xv, dv):
        """fetch's words into buffer `buf`: staged row tid // 4's codes as int8 (the low nibbles
        of its 16 bytes are elements of sub-block 2·(p // 2), the high ones of the next) and
        sub-block p's d·sc, dmin·m; the slots' q8 bytes and (dx, xs)."""
        tid = cuda.threadIdx.x
        r, p = tid >> 2, tid & 3
        sub = 2 * (p >> 1)  # local sub-block of the low nibbles
        bit = 4 * (c & 1) + sub  # ... its index in the super-block: its 5th bits' bit
        at = uint32(buf * TILE_WORDS + r * ROW_WORDS + 8 * sub + 4 * (p & 1))
        for e in range(4):
            lo, hi = wv[e] & M4, (wv[e] >> 4) & M4
            if five_bits:
                lo |= ((wv[8 + e] >> bit) & M1) << 4
                hi |= ((wv[8 + e] >> (bit + 1)) & M1) << 4
            sa[at + uint32(e)] = lo
            sa[at + uint32(8 + e)] = hi  # the next sub-block: 32 bytes on
        sc, mn = scale_min_k4(4 * (c & 1) + p, wv[5], wv[6], wv[7])
        at = uint32(buf * SCALES + p * BM + r)
        sw[at] = f16(wv[4]) * float32(sc)
        sw[at + uint32(SUBS * BM)] = f16(wv[4] >> 16) * float32(mn)
        for i in range(X_LOADS):
            at = uint32(buf * TILE_WORDS + ((tid >> 3) + 32 * i) * ROW_WORDS + 4 * (tid & 7))
            for e in range(4):
                sb[at + uint32(e)] = xv[4 * i + e]
        at = uint32(buf * SCALES + (tid & 3) * BN + (tid >> 2))
        sx[at] = dv[0]
        sx[at + uint32(SUBS * BN)] = dv[1]

    return fetch, put


# ---------------------------------------------------------------- the warps' mma
@device_function(numba_inline=True)
def _add_scaled(acc, sx, x_at, n, c, scales):
    """acc of n8 tile n += its s32 sums c of one sub-block: scale·c·dx − min·xs, for rows g,
    g + 8 (scales: their scales, mins and the scales' sum_offset, each lo, hi) × slots 2t,
    2t + 1 of the tile."""
    at = x_at + uint32(8 * n)
    dx0, dx1 = sx[at], sx[at + uint32(1)]
    xs0, xs1 = sx[at + uint32(SUBS * BN)], sx[at + uint32(SUBS * BN + 1)]
    # NOTE: acc + a·b − c·d, left to right: two FMAs
    acc[4 * n] = acc[4 * n] + scaled_sum(c[0], scales[0], scales[4]) * dx0 - scales[2] * xs0
    acc[4 * n + 1] = acc[4 * n + 1] + scaled_sum(c[1], scales[0], scales[4]) * dx1 - scales[2] * xs1
    acc[4 * n + 2] = acc[4 * n + 2] + scaled_sum(c[2], scales[1], scales[5]) * dx0 - scales[3] * xs0
    acc[4 * n + 3] = acc[4 * n + 3] + scaled_sum(c[3], scales[1], scales[5]) * dx1 - scales[3] * xs1


@device_function(numba_inline=True)
def _two_tiles(acc, a, sb, sx, b_at, x_at, p, scales, lane):
    """acc of the warp's n8 tiles 2p, 2p + 1 (one ldmatrix of 16 slots: (b0, b1), (b2, b3))."""
    b = ldmatrix_x4_b8_pairs(sb, b_at + uint32(16 * p * TILE_STRIDE), TILE_STRIDE, lane)
    c = mma_s8_biased(a, b[0], b[1])
    _add_scaled(acc, sx, x_at, 2 * p, c, scales)
    c = mma_s8_biased(a, b[2], b[3])
    _add_scaled(acc, sx, x_at, 2 * p + 1, c, scales)


@device_function(numba_inline=True)
def _sub_block(sa, sb, sw, sx, acc, a_at, b_at, w_at, x_at, lane, n_groups, j):
    """acc += this warp's 16 rows × its n_groups 16-slot groups over sub-block j (a constant)
    of the step."""
    a = ldmatrix_x4_b8(sa, a_at + uint32(32 * j), TILE_STRIDE, lane)
    at = w_at + uint32(j * BM)
    lo, hi = sw[at], sw[at + uint32(8)]
    scales = (lo, hi, sw[at + uint32(SUBS * BM)], sw[at + uint32(SUBS * BM + 8)],
              sum_offset(lo), sum_offset(hi))
    x_at += uint32(j * BN)
    # NOTE: two calls, not a loop: acc's indices must be constants for it to stay in registers
    _two_tiles(acc, a, sb, sx, b_at + uint32(32 * j), x_at, 0, scales, lane)
    if n_groups > 1:
        _two_tiles(acc, a, sb, sx, b_at + uint32(32 * j), x_at, 1, scales, lane)


@device_function(numba_inline=True)
def _multiply(buf, sa, sb, sw, sx, acc, n_groups):
    """acc += this warp's 16 rows × 32 slots over step buffer `buf` (SUBS int8 mma k steps).
    Each lane's shared-memory indices are computed once here, every sub-block's are these plus
    constants."""
    lane, warp = cuda.threadIdx.x & 31, cuda.threadIdx.x >> 5
    rows = 16 * (warp & 3)  # the warp's first staged row
    slots = WARP_TOKENS * (warp >> 2)  # ... and first slot of the tile
    a_at = uint32(4 * buf * TILE_WORDS + rows * TILE_STRIDE)  # bytes in sa
    b_at = uint32(4 * buf * TILE_WORDS + slots * TILE_STRIDE)  # bytes in sb
    w_at = uint32(buf * SCALES + rows + (lane >> 2))  # row g's scale, sub-block 0
    x_at = uint32(buf * SCALES + slots + 2 * (lane & 3))  # slot 2t's dx, sub-block 0
    # NOTE: one call a sub-block, not a loop: constant j folds its offsets into the loads
    _sub_block(sa, sb, sw, sx, acc, a_at, b_at, w_at, x_at, lane, n_groups, 0)
    _sub_block(sa, sb, sw, sx, acc, a_at, b_at, w_at, x_at, lane, n_groups, 1)
    _sub_block(sa, sb, sw, sx, acc, a_at, b_at, w_at, x_at, lane, n_groups, 2)
    _sub_block(sa, sb, sw, sx, acc, a_at, b_at, w_at, x_at, lane, n_groups, 3)


# ---------------------------------------------------------------- the kernel
@device_function(numba_inline=True)
def _staged_row(row0, swiglu):
    """(matrix row, is an up row) this thread stages: staged row tid // 4; with SwiGLU each
    16 staged rows are 8 gate rows and the same 8 rows of `up`."""
    r = cuda.threadIdx.x >> 2
    if swiglu:
        return row0 + 8 * (r >> 4) + (r & 7), (r & 15) >= 8
    return row0 + r, False


@device_function(numba_inline=True)
def _slot_rows(x_rows, lo, n_valid, order, slot_x):
    """x_rows ← the activation rows of the slots this thread stages (slots past the tile's end
    repeat its last slot: computed, never stored)."""
    tid = cuda.threadIdx.x
    last = n_valid - 1
    x_rows[0] = int64(slot_x[order[lo + min(tid >> 3, last)]])  # q8 words of fetch's xv
    x_rows[1] = int64(slot_x[order[lo + min(32 + (tid >> 3), last)]])
    x_rows[2] = int64(slot_x[order[lo + min(tid >> 2, last)]])  # its (dx, xs)


@device_function(numba_inline=True)
def _store(acc, row0, n_rows, lo, n_valid, order, swiglu, y0, y1, y2, y3, ends):
    """The warp's C fragments → y[order[lo + slot]]: lane (g, t) holds rows g, g + 8 (with
    SwiGLU: the gate and up sums of one output row) × slots 2t, 2t + 1 of each n8 tile."""
    lane, warp = cuda.threadIdx.x & 31, cuda.threadIdx.x >> 5
    slots = WARP_TOKENS * (warp >> 2) + 2 * (lane & 3)
    g = lane >> 2
    for n in range(WARP_TOKENS // 8):
        if swiglu:
            row = row0 + 8 * (warp & 3) + g
            for e in range(2):
                j = slots + 8 * n + e
                if row < n_rows and j < n_valid:
                    v = gemm_epilogue(acc[4 * n + e], acc[4 * n + e + 2], True, y0, False, row)
                    store_part(y0, y1, y2, y3, ends, order[lo + j], row, v)
        else:
            for e in range(4):
                row = row0 + 16 * (warp & 3) + g + 8 * (e >> 1)
                j = slots + 8 * n + (e & 1)
                if row < n_rows and j < n_valid:
                    store_part(y0, y1, y2, y3, ends, order[lo + j], row, acc[4 * n + e])


@functools.cache
def _gemm_kernel(ggml_type: GGMLType, swiglu: bool):
    fetch, put = _stage_fns(ggml_type)
    rows_block = BM // 2 if swiglu else BM  # output rows a block
    n_acc = 4 * WARP_TOKENS // 8
    # shared / local array sizes as closure constants (numba needs literals)
    tile_words, scale_floats = 2 * TILE_WORDS, 2 * SCALES
    w_words, x_words = (12 if ggml_type == GGMLType.Q5_K else 8), 4 * X_LOADS

    @kernel(fastmath=True, **_LAUNCH_BOUNDS)
    def gemm_k(w, w2, row_bytes, n_rows, mat_bytes, k, xq, xd, xs, tile_expert, tile_lo,
               tile_hi, order, slot_x, y0, y1, y2, y3, ends):
        chain_start()
        lo, n_valid, mat = block_tile(True, BN, 0, tile_expert, tile_lo, tile_hi)
        if n_valid <= 0:
            return
        row0 = cuda.blockIdx.x * rows_block
        row, is_up = _staged_row(row0, swiglu)
        w_off = int64(mat) * mat_bytes + int64(min(row, n_rows - 1)) * row_bytes
        w_src = w2 if is_up else w
        x_rows = cuda.local.array(3, int64)
        _slot_rows(x_rows, lo, n_valid, order, slot_x)
        sa = cuda.shared.array(tile_words, uint32, alignment=LDMATRIX_ALIGN)  # (2, BM, stride)
        sb = cuda.shared.array(tile_words, uint32, alignment=LDMATRIX_ALIGN)  # (2, BN, stride)
        sw = cuda.shared.array(scale_floats, float32)  # (2, scale | min, SUBS, BM)
        sx = cuda.shared.array(scale_floats, float32)  # (2, dx | xs, SUBS, BN)
        wv = cuda.local.array(w_words, uint32)
        xv = cuda.local.array(x_words, uint32)
        dv = cuda.local.array(2, float32)
        acc = cuda.local.array(n_acc, float32)  # (4 n8 tiles, 4) C fragments
        for i in range(n_acc):
            acc[i] = 0.0
        warp = cuda.threadIdx.x >> 5
        n_groups = min(2, (n_valid - WARP_TOKENS * (warp >> 2) + 15) // 16)  # ≤ 0: idle
        n_steps = k // STEP_K
        fetch(0, w_src, w_off, xq, xd, xs, k, x_rows, wv, xv, dv)
        put(0, 0, sa, sb, sw, sx, wv, xv, dv)
        cuda.syncthreads()
        for s in range(n_steps):
            # step s + 1's loads go out before step s's mma (the last step fetches itself again)
            nxt = min(s + 1, n_steps - 1)
            fetch(nxt, w_src, w_off, xq, xd, xs, k, x_rows, wv, xv, dv)
            if n_groups > 0:
                _multiply(s & 1, sa, sb, sw, sx, acc, n_groups)
            put(nxt, (s + 1) & 1, sa, sb, sw, sx, wv, xv, dv)
            cuda.syncthreads()
        _store(acc, row0, n_rows, lo, n_valid, order, swiglu, y0, y1, y2, y3, ends)
    return gemm_k


# ---------------------------------------------------------------- launch
def grouped_matmul(w: DeviceQuantMatrix, x: QuantizedActivations, y, route, slot_x, *,
                   up: DeviceQuantMatrix | None = None, stream=0) -> None:
    """MoE prefill: y[slot] (n_slots, n_rows) f32 ← q8 activations x[slot_x[slot]] @
    W[expert(slot)]ᵀ, x holding n_x rows of k = W's k.

    route: an expert_route.ExpertRoute filled by route_experts for these n_slots, tile ≤ BN.
    slot_x: int32 device array (n_slots,). up: a second matrix of W's type and shape; then
    y = silu(x·Wᵀ) ⊙ (x·upᵀ). y may be split by row range like mma_gemm.matmul's.
    Raises ValueError for what `supports` rejects."""
    if not supports(w) or x.shape[2] != w.k:
        raise ValueError(f"no int8 grouped GEMM for {w.ggml_type.name} k={w.k} over "
                         f"activations of {x.shape[2]}")
    if up is not None and (up.ggml_type, up.k, up.n_rows, up.n_mats) != (
            w.ggml_type, w.k, w.n_rows, w.n_mats):
        raise ValueError("gate and up matrices must share type and shape for the fused SwiGLU")
    if route.tile > BN:
        raise ValueError(f"route tile {route.tile} exceeds the GEMM's {BN} slots")
    check_array("slot_x", slot_x, np.int32)
    n_slots = slot_x.shape[0]
    parts, ends = output_parts(y, n_slots, w.n_rows)
    if n_slots == 0:
        return  # nothing to compute (and a grid of 0 blocks is a launch error)
    swiglu = up is not None
    grid = (cdiv(w.n_rows, BM // 2 if swiglu else BM), route.tiles_bound(n_slots), 1)
    _gemm_kernel(w.ggml_type, swiglu)[grid, THREADS, stream](
        w.data, w.data if up is None else up.data, w.row_bytes, w.n_rows,
        w.n_rows * w.row_bytes, w.k, x.xq, x.xd, x.xs, route.tile_expert, route.tile_lo,
        route.tile_hi, route.order, slot_x, *parts, ends)
