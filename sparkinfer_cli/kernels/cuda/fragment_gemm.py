"""Prefill GEMM on tensor cores that dequantizes GGUF codes straight into the mma A fragments.

y[slot, r] = Σ_k W[mat][r, k] · x[xrow(slot), k] (+ bias[r])   (mma.sync m16n8k16, f16·f16 → f32)

mma_gemm stages every weight as f16 in shared memory: ~6 instructions a weight (unpack, convert,
scale, pack), which left its blocks issue-bound far under the tensor cores' rate. Here the block
copies each k step's raw codes into shared memory (Q4_K: 16 qs bytes and the super-block header
a thread, rearranged with four byte permutes so that each lane finds its fragment's codes in one
8-byte word), and each warp turns its own 16 rows' codes into A fragments with f16x2 arithmetic:
a nibble masked into the mantissa of 1024.0 (`| 0x6400`), minus 1024 (exact), times the
sub-block's scale plus its offset in one fused f16x2 multiply-add: four instructions a pair of
weights, shared by the warp's BN tokens. mma_gemm keeps the other types; measured on the H200
(bench/results/2026-12-04-fragment-gemm.md), the same scheme ran slower than its staging for
Q5_K (the 5th bits: 20 staged words a row, 126 registers) and Q8_0 (2-byte-aligned 34-byte
blocks: more loads and permutes than the staging saved); Q6_K's 210-byte blocks are not 16-byte
aligned.

Numerics: a weight is f16(q·s + m) with s = d·sc and m = −dmin·mn rounded to f16 first (mma_gemm
rounds the float32 q·s + m once); activations are f16 in both.

- A block: BM = 128 staged weight rows × BN tokens (16-64), 8 warps of 16 rows × all BN tokens
  (BN / 8 n8 tiles of f32 accumulators a warp), k in steps of BK = 64 through two shared buffers
  (each thread loads its share of step s + 1 into registers, the warps multiply step s, then the
  loads are stored to the other buffer: one barrier a step). Activations are read as float32 and
  stored as f16 by the same staging, in rounds of 16 threads a token (whole sectors a load); a
  lane reads its rows' staged codes and scales in vector loads. Both cut the block's L1 traffic,
  which bounded the kernel (bench/results/2026-12-06-expert-gemm-l1-traffic.md).
- Fused SwiGLU (`up=`): each warp's rows 0-7 are 8 gate rows and rows 8-15 the same rows of `up`,
  so a lane holds the gate and up sums of one output in its C elements e and e + 2.
- Split-K over grid.z and the output parts as mma_gemm (same partials layout, so its
  add_partials finishes a split product).

What bounds the expert products in each serving regime, what the fast public MoE kernels do
differently, and the changes ranked: docs/moe-expert-gemm.md.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, int64, uint32

from sparkinfer_cli.gguf.ggml_types import GGMLType
from sparkinfer_cli.kernels.cuda.ggml_blocks import f16, scale_min_k4
from sparkinfer_cli.kernels.cuda.mma_fragments import (
    block_tile,
    gemm_epilogue,
    k_range,
    mma_into,
)
from sparkinfer_cli.kernels.cuda.quant_gemv import store_part
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import (
    IS_SIMULATOR,
    LDMATRIX_ALIGN,
    bits_to_f32,
    byte_perm,
    chain_start,
    hfma2,
    hsub2,
    ld_v4_u32,
    ldmatrix_x4_pairs,
    lds_v2_u32,
    lds_v4_u32,
    pack_f16x2,
)
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel

BM = 128  # staged weight rows a block (8 warps × 16)
BK = 64  # k elements a pipeline step
THREADS = 256
TILES = (16, 32, 64)  # BN: tokens a block (128 would hold 64 accumulators a lane: spilled)
X_WORDS = 36  # u32 between staged tokens: 64 f16 + 16 pad bytes (ldmatrix rows in distinct banks)
X_STRIDE = 4 * X_WORDS
# Activations are staged in rounds: a round's thread loads 16 bytes (4 floats) of one token's k
# step, 16 consecutive threads one token's 256 bytes, so a warp's load reads two tokens' whole
# sectors (a thread reading its own token's consecutive 16-byte pieces put every lane of a load in
# a half-used sector of its own, and the kernel was L1-bound).
X_CHUNK_THREADS = BK // 4
X_CHUNK_TOKENS = THREADS // X_CHUNK_THREADS  # tokens a round stages
MAX_X_FLOATS = 2**32  # activations are indexed by 32-bit float offsets (fewer registers)
_MAGIC = 0x64006400  # f16x2 (1024, 1024): a code in the low mantissa bits reads as 1024 + code


def x_loads_a_thread(bn: int) -> int:
    """16-byte activation loads a thread makes a k step of a bn-token tile."""
    return bn // X_CHUNK_TOKENS


# ---------------------------------------------------------------- Q4_K
# Staged codes of a row, a step (64 elements = sub-blocks 2p, 2p+1 of a super-block: the low and
# high nibbles of the same 32 qs bytes b): words 2t, 2t+1 hold, for lane quad t, bytes
# (b[2t], b[2t+8], b[2t+1], b[2t+9]) of the first 16 bytes, then the same of the last 16, so that
# (word >> s) & 0x000F000F puts the nibbles of elements (2t, 2t+1) (s = 0 / 4: low / high nibble)
# or (2t+8, 2t+9) (s = 8 / 12) in the two f16 halves. Then 4 scale words: f16x2 (s, s), (m, m)
# of each sub-block (value = s·q + m).
_Q4K_ROW_WORDS = 12  # a multiple of 4: each row's scale words load as one 16-byte vector


@device_function(numba_inline=True)
def _put_lane_order(sw, at, w0, w1, w2, w3):
    """16 bytes (4 words) → words at, at + 2, at + 4, at + 6 in the lane quads' byte order."""
    sw[uint32(at)] = byte_perm(w0, w2, 0x5140)
    sw[uint32(at + 2)] = byte_perm(w0, w2, 0x7362)
    sw[uint32(at + 4)] = byte_perm(w1, w3, 0x5140)
    sw[uint32(at + 6)] = byte_perm(w1, w3, 0x7362)


@device_function(numba_inline=True)
def _put_k_scales(sw, at, h, k0, hdr0, s0, s1, s2):
    """f16x2 (scale, scale), (offset, offset) of sub-block 2p + h from the super-block header."""
    sc, mn = scale_min_k4(2 * ((k0 >> 6) & 3) + h, s0, s1, s2)
    scale = f16(hdr0) * float32(sc)
    shift = -(f16(hdr0 >> 16) * float32(mn))
    sw[uint32(at + 2 * h)] = pack_f16x2(scale, scale)
    sw[uint32(at + 2 * h + 1)] = pack_f16x2(shift, shift)


@device_function(numba_inline=True)
def _fetch_q4_k(w, row_off, k0, h):
    """Thread h of a row: its 16 qs bytes of the step and the super-block's 16-byte header."""
    sb = row_off + (k0 >> 8) * 144
    qs = ld_v4_u32(w, sb + 16 + 32 * ((k0 >> 6) & 3) + 16 * h)
    hdr = ld_v4_u32(w, sb)
    return (qs[0], qs[1], qs[2], qs[3], hdr[0], hdr[1], hdr[2], hdr[3])


@device_function(numba_inline=True)
def _put_q4_k(sw, at, h, k0, v):
    _put_lane_order(sw, at + h, v[0], v[1], v[2], v[3])
    _put_k_scales(sw, at + 8, h, k0, v[4], v[5], v[6], v[7])


@device_function(numba_inline=True)
def _row_q4_k(sw, at, t):
    """A lane's registers of one staged row for the whole step: its two code words and the two
    sub-blocks' (scale, offset) pairs, in two vector loads (a row starts on a 16-byte boundary).
    (Shared memory is indexed unsigned throughout: a signed index costs a compare and a select an
    access for numba's negative-index wrap.)"""
    codes = lds_v2_u32(sw, uint32(at + 2 * t))
    scales = lds_v4_u32(sw, uint32(at + 8))
    return (codes[0], codes[1], scales[0], scales[1], scales[2], scales[3])


@device_function(numba_inline=True)
def _a_q4_k(r, c, hi):
    """A register of piece c (k 16c..16c+15 of the step): elements (2t, 2t+1) or, hi, (2t+8,
    2t+9) of the piece, as f16x2."""
    v = ((r[c & 1] >> (4 * (c >> 1) + 8 * hi)) & 0x000F000F) | _MAGIC
    return hfma2(hsub2(v, _MAGIC), r[2 + 2 * (c >> 1)], r[3 + 2 * (c >> 1)])


# per type: fetch, put, row registers, A register, staged words a row, and the blocks an SM its
# kernel without SwiGLU is bounded to (3: ≤ 80 registers; the SwiGLU kernel spilled under it)
_TYPES = {
    GGMLType.Q4_K: (_fetch_q4_k, _put_q4_k, _row_q4_k, _a_q4_k, _Q4K_ROW_WORDS, 3),
}


def supports(ggml_type: int, k: int) -> bool:
    """Whether this GEMM takes a matrix of this type and row length (whole BK steps)."""
    return ggml_type in _TYPES and k % BK == 0


# ---------------------------------------------------------------- the kernel
@functools.cache
def _walk_fn(ggml_type: GGMLType, bn: int):
    """walk: a block's k steps s0..s1 into this warp's accumulators."""
    fetch, put, row_regs, a_reg, row_words, _ = _TYPES[ggml_type]
    w_words, x_words = BM * row_words, bn * X_WORDS
    x_loads = x_loads_a_thread(bn)
    x_floats = 4 * x_loads  # a thread's staged activations a step
    n_pairs = bn // 16

    @device_function(numba_inline=True)
    def stage(sw, sx, buf, wv, xv, w_at, h, k0, x_at):
        put(sw, buf * w_words + w_at, h, k0, wv)
        base = uint32(buf * x_words + x_at)
        for i in range(x_loads):
            at = uint32(base + i * X_CHUNK_TOKENS * X_WORDS)
            sx[at] = pack_f16x2(xv[4 * i], xv[4 * i + 1])
            sx[uint32(at + 1)] = pack_f16x2(xv[4 * i + 2], xv[4 * i + 3])

    @device_function(numba_inline=True)
    def fetch_x(x, x_offs, k0, xv):
        for i in range(x_loads):
            q = ld_v4_u32(x, int64(x_offs[i] + uint32(k0)) * 4)
            for j in range(4):
                xv[4 * i + j] = bits_to_f32(q[j])

    @device_function(numba_inline=True)
    def multiply(sw, sx, buf, lane, warp, acc):
        at = buf * w_words + (16 * warp + (lane >> 2)) * row_words
        top = row_regs(sw, at, lane & 3)
        bottom = row_regs(sw, at + 8 * row_words, lane & 3)
        x_base = 4 * buf * x_words
        for c in range(4):
            a = (a_reg(top, c, 0), a_reg(bottom, c, 0), a_reg(top, c, 1), a_reg(bottom, c, 1))
            for p in range(n_pairs):
                b = ldmatrix_x4_pairs(sx, x_base + 16 * p * X_STRIDE + 32 * c, X_STRIDE, lane)
                mma_into(acc, 8 * p, a, b[0], b[1])
                mma_into(acc, 8 * p + 4, a, b[2], b[3])

    @device_function(numba_inline=True)
    def walk(s0, s1, w_src, w_off, h, w_at, x, x_offs, x_at, sw, sx, lane, warp, acc):
        xv = cuda.local.array(x_floats, float32)
        wv = fetch(w_src, w_off, s0 * BK, h)
        fetch_x(x, x_offs, s0 * BK, xv)
        stage(sw, sx, 0, wv, xv, w_at, h, s0 * BK, x_at)
        cuda.syncthreads()
        for s in range(s1 - s0):
            # step s + 1's loads go out before step s's mma and land in the other buffer after
            # them (the last step fetches itself again, into the idle buffer: branch-free)
            k1 = (s0 + min(s + 1, s1 - s0 - 1)) * BK
            wv = fetch(w_src, w_off, k1, h)
            fetch_x(x, x_offs, k1, xv)
            multiply(sw, sx, s & 1, lane, warp, acc)
            stage(sw, sx, (s + 1) & 1, wv, xv, w_at, h, k1, x_at)
            cuda.syncthreads()
    return walk


@functools.cache
def _store_fns(bn: int, swiglu: bool, grouped: bool):
    """(store, store_sums): this lane's C elements → y through the epilogue, or (split k) the
    raw sums → the partials (mma_gemm's layout). A lane holds rows lane//4 (+8: elements e ≥ 2)
    × tokens 2·(lane%4) (+1) of each n8 tile; with SwiGLU rows +8 are the up rows of the same
    outputs. Each loop nest covers elements (eh, eh + 1) of the n8 tiles: ≤ 16 iterations, which
    LLVM unrolls, so the accumulators stay in registers (a nest over all 32 of a 64-token tile
    was left rolled and put them in local memory)."""
    n_tiles = bn // 8
    staged = 2 if swiglu else 1

    @device_function(numba_inline=True)
    def fragment(ni, e, row0):
        lane, warp = cuda.threadIdx.x & 31, cuda.threadIdx.x >> 5
        row = row0 + (8 if swiglu else 16) * warp + (lane >> 2) + 8 * (e >> 1)
        return row, 8 * ni + 2 * (lane & 3) + (e & 1)

    @device_function(numba_inline=True)
    def store_pairs(acc, eh, row0, n_rows, lo, n_valid, order, bias, has_bias, y0, y1, y2, y3,
                    ends):
        for ni in range(n_tiles):
            for e in range(eh, eh + 2):
                row, j = fragment(ni, e, row0)
                if row < n_rows and j < n_valid:
                    up = acc[4 * ni + e + 2] if swiglu else float32(0.0)
                    v = gemm_epilogue(acc[4 * ni + e], up, swiglu, bias, has_bias, row)
                    store_part(y0, y1, y2, y3, ends, order[lo + j] if grouped else lo + j, row, v)

    @device_function(numba_inline=True)
    def store(acc, row0, n_rows, lo, n_valid, order, bias, has_bias, y0, y1, y2, y3, ends):
        store_pairs(acc, 0, row0, n_rows, lo, n_valid, order, bias, has_bias, y0, y1, y2, y3,
                    ends)
        if not swiglu:
            store_pairs(acc, 2, row0, n_rows, lo, n_valid, order, bias, has_bias, y0, y1, y2,
                        y3, ends)

    @device_function(numba_inline=True)
    def sums_pairs(acc, eh, row0, n_rows, lo, n_valid, order, part, n_slots):
        for ni in range(n_tiles):
            for e in range(eh, eh + 2):
                row, j = fragment(ni, e, row0)
                if row < n_rows and j < n_valid:
                    slot = order[lo + j] if grouped else lo + j
                    at = (int64(cuda.blockIdx.z) * n_slots + slot) * (n_rows * staged) + row
                    part[at] = acc[4 * ni + e]
                    if swiglu:
                        part[at + n_rows] = acc[4 * ni + e + 2]

    @device_function(numba_inline=True)
    def store_sums(acc, row0, n_rows, lo, n_valid, order, part, n_slots):
        sums_pairs(acc, 0, row0, n_rows, lo, n_valid, order, part, n_slots)
        if not swiglu:
            sums_pairs(acc, 2, row0, n_rows, lo, n_valid, order, part, n_slots)
    return store, store_sums


@functools.cache
def _operands_fn(bn: int, swiglu: bool, grouped: bool):
    x_loads = x_loads_a_thread(bn)

    @device_function(numba_inline=True)
    def operands(row0, mat, n_rows, row_bytes, mat_bytes):
        """What this thread stages: (is an up row, weight row byte offset, the smem word of its
        first activation piece). Thread pair 2r, 2r+1 stage row r's halves; with SwiGLU, warp
        rows 0-7 are gate rows and 8-15 the same rows of up. Rows past the matrix repeat its last
        row (computed, never stored)."""
        tid = cuda.threadIdx.x
        r = tid >> 1
        w_row = row0 + r
        is_up = False
        if swiglu:
            w_row = row0 + 8 * (r >> 4) + (r & 7)
            is_up = (r & 15) >= 8
        w_off = int64(mat) * mat_bytes + int64(min(w_row, n_rows - 1)) * row_bytes
        piece = tid % X_CHUNK_THREADS
        return is_up, w_off, (tid // X_CHUNK_THREADS) * X_WORDS + 2 * piece

    @device_function(numba_inline=True)
    def x_offsets(x_offs, lo, n_valid, k, order, slot_x):
        """x_offs[i]: float offset in x of this thread's piece of round i's token (without the
        step's k0). Tokens past the tile's end repeat its last token (computed, never stored)."""
        tid = cuda.threadIdx.x
        piece = tid % X_CHUNK_THREADS
        for i in range(x_loads):
            j = min(i * X_CHUNK_TOKENS + tid // X_CHUNK_THREADS, n_valid - 1)
            xrow = slot_x[order[lo + j]] if grouped else lo + j
            x_offs[i] = uint32(xrow * k + 4 * piece)
    return operands, x_offsets


@functools.cache
def gemm_kernel(ggml_type: GGMLType, bn: int, swiglu: bool, grouped: bool):
    """The kernel for weights of ggml_type in tiles of bn tokens; mma_gemm's argument list
    (its launch wrapper picks this kernel for the types it supports)."""
    walk = _walk_fn(ggml_type, bn)
    operands, x_offsets = _operands_fn(bn, swiglu, grouped)
    store, store_sums = _store_fns(bn, swiglu, grouped)
    row_words, blocks = _TYPES[ggml_type][4:]
    rows_block = BM // 2 if swiglu else BM
    sw_size, sx_size, n_acc = 2 * BM * row_words, 2 * bn * X_WORDS, bn // 2
    x_loads = x_loads_a_thread(bn)

    bounds = {} if swiglu or blocks < 3 or IS_SIMULATOR else {"launch_bounds": (THREADS, blocks)}

    @kernel(fastmath=True, **bounds)
    def gemm(w, w2, row_bytes, n_rows, mat_bytes, k, n_tok, x, tile_expert, tile_lo, tile_hi,
             order, slot_x, bias, has_bias, y0, y1, y2, y3, ends, part):
        chain_start()
        lo, n_valid, mat = block_tile(grouped, bn, n_tok, tile_expert, tile_lo, tile_hi)
        if n_valid <= 0:
            return
        row0 = cuda.blockIdx.x * rows_block
        is_up, w_off, x_at = operands(row0, mat, n_rows, row_bytes, mat_bytes)
        x_offs = cuda.local.array(x_loads, uint32)
        x_offsets(x_offs, lo, n_valid, k, order, slot_x)
        # (2 buffers, BM rows, row_words)
        sw = cuda.shared.array(sw_size, uint32, alignment=LDMATRIX_ALIGN)
        sx = cuda.shared.array(sx_size, uint32, alignment=LDMATRIX_ALIGN)  # (2, bn, X_WORDS)
        acc = cuda.local.array(n_acc, float32)  # (bn / 8 n8 tiles, 4) C fragments
        for i in range(n_acc):
            acc[i] = 0.0
        lane, warp = cuda.threadIdx.x & 31, cuda.threadIdx.x >> 5
        s0, s1 = k_range(k // BK)
        h = cuda.threadIdx.x & 1
        w_at = (cuda.threadIdx.x >> 1) * row_words
        walk(s0, s1, w2 if is_up else w, w_off, h, w_at, x, x_offs, x_at, sw, sx, lane, warp,
             acc)
        if cuda.gridDim.z > 1:
            store_sums(acc, row0, n_rows, lo, n_valid, order, part, n_tok)
        else:
            store(acc, row0, n_rows, lo, n_valid, order, bias, has_bias, y0, y1, y2, y3, ends)
    return gemm
