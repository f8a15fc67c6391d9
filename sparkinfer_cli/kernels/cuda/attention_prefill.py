"""Causal attention of many query tokens over a paged KV cache, sharing each K/V tile between them.

attention.py's decode kernel treats every query row on its own, so a prefill of T tokens reads the
sequence's K/V T times. Here one block owns ROWS query rows, the G = n_heads / n_kv q heads that
share one kv head times ROWS / G consecutive tokens, and walks the keys KT at a time: each K and V
tile is staged (dequantized to float32) in shared memory once and used by all ROWS rows, with an
online softmax per row (running max / sum, keys at or past a row's seq_len masked) and float32
accumulation, the decode kernel's numerics. Same inputs as paged_decode_attention (its row_seq /
seq_lens form, so the new tokens' K/V must already be in the cache), minus the split workspace.

Per key tile, 256 threads:
  1. S (ROWS, KT) = Q·Kᵀ over head_dim in DC-wide chunks (Q chunk and K chunk staged together);
     thread (ty, tx) = (tid // 16, tid % 16) holds rows ty + 16i and keys tx + 16j, i, j < 4;
  2. online-softmax update: each row's 16 partial maxima / sums meet in shared memory, where the
     row's running max and sum live; P (KT, ROWS) → shared memory;
  3. O (ROWS, head_dim) += P·V, V staged in sub-tiles of VK keys; warp w holds rows [8w, 8w + 8),
     its lanes head_dim / 4 quads of dims (the accumulators stay in registers all along).
A tile of ROWS / G tokens may hold the tail of one sequence and the head of the next: the block
runs once per run of rows with the same row_seq (only the rows of that run are live).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, int64

from sparkinfer_cli.kernels.cuda.attention import KV_F16, KV_F32, KV_I8, flat_scales, kv_kind
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import (
    IS_SIMULATOR,
    bits_to_f32,
    chain_start,
    f16_bits_to_f32,
    ld_u32,
    ld_v2_u32,
    ld_v4_u32,
)
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv, check_array

ROWS = 64  # query rows per block: q heads of one kv head × tokens
KT = 64  # keys per tile
DC = 32  # head dims per Q·Kᵀ staging chunk
THREADS = 256
QK_STRIDE = DC + 4  # floats per staged Q/K row: 16-byte aligned, quarter-warps hit distinct banks
P_STRIDE = ROWS + 4  # floats per staged P row (one per key)
V_FLOATS = 4096  # staged V sub-tile: (VK, head_dim) with VK = V_FLOATS / head_dim
BUF_FLOATS = max(2 * ROWS * QK_STRIDE, V_FLOATS)  # shared buffer of a Q|K chunk or a V sub-tile
P_FLOATS = KT * P_STRIDE
RED_FLOATS = ROWS * 16  # per-thread partial row max / sum of a score tile
HEAD_DIMS = (64, 128, 256)
# NOTE: fastmath lets LLVM assume no infinities, so masked scores / empty rows use a finite floor.
MASKED = -1e30

SMEM_ALIGN = None if IS_SIMULATOR else 16  # 16-byte vector access (the simulator has no alignment)

if IS_SIMULATOR:

    def ld_shared_v4(arr, idx):
        return arr[idx], arr[idx + 1], arr[idx + 2], arr[idx + 3]

    def st_shared_v4(arr, idx, a, b, c, d):
        arr[idx], arr[idx + 1], arr[idx + 2], arr[idx + 3] = a, b, c, d

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _V4 = ir.VectorType(ir.FloatType(), 4)

    def _shared_quad(context, builder, arrty, arr, idxty, idx):
        """<4 x float> addrspace(3)* to elements [idx, idx + 4) of a float32 shared array."""
        data = context.make_array(arrty)(context, builder, value=arr).data
        elem = builder.gep(data, [context.cast(builder, idx, idxty, types.int64)])
        return builder.addrspacecast(builder.bitcast(elem, ir.PointerType(_V4)),
                                     ir.PointerType(_V4, addrspace=3))

    def _is_f32_array(arr, idx) -> bool:
        return isinstance(arr, types.Array) and arr.dtype == types.float32 and \
            isinstance(idx, types.Integer)

    @intrinsic
    def ld_shared_v4(typingctx, arr, idx):
        """arr[idx : idx + 4] of a float32 shared array as one 16-byte load (idx % 4 == 0)."""
        if not _is_f32_array(arr, idx):
            return None

        def codegen(context, builder, sig, args):
            vec = builder.load(_shared_quad(context, builder, sig.args[0], args[0], sig.args[1],
                                            args[1]), align=16)
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_element(vec, ir.Constant(ir.IntType(32), e))
                                       for e in range(4)])
        return types.UniTuple(types.float32, 4)(arr, idx), codegen

    @intrinsic
    def st_shared_v4(typingctx, arr, idx, a, b, c, d):
        """arr[idx : idx + 4] = (a, b, c, d) as one 16-byte store (idx % 4 == 0)."""
        if not _is_f32_array(arr, idx):
            return None

        def codegen(context, builder, sig, args):
            vec = ir.Constant(_V4, ir.Undefined)
            for e in range(4):
                val = context.cast(builder, args[2 + e], sig.args[2 + e], types.float32)
                vec = builder.insert_element(vec, val, ir.Constant(ir.IntType(32), e))
            builder.store(vec, _shared_quad(context, builder, sig.args[0], args[0], sig.args[1],
                                            args[1]), align=16)
            return context.get_dummy_value()
        return types.void(arr, idx, a, b, c, d), codegen


@device_function
def _i8(w, e):
    """Signed byte e of the 32-bit word w as float32."""
    b = int32((w >> (8 * e)) & 0xFF)
    return float32(b - 2 * (b & 0x80))


@device_function
def _load_quad(src, scales, off, kind, mul):
    """src[off : off + 4] (off % 4 == 0) as float32 × mul (KV_I8: × its 32-block's scale too)."""
    if kind == KV_I8:
        w = ld_u32(src, off)
        d = scales[off // 32] * mul
        return _i8(w, 0) * d, _i8(w, 1) * d, _i8(w, 2) * d, _i8(w, 3) * d
    if kind == KV_F16:
        lo, hi = ld_v2_u32(src, 2 * off)
        return (f16_bits_to_f32(lo & 0xFFFF) * mul, f16_bits_to_f32(lo >> 16) * mul,
                f16_bits_to_f32(hi & 0xFFFF) * mul, f16_bits_to_f32(hi >> 16) * mul)
    w = ld_v4_u32(src, 4 * off)
    return (bits_to_f32(w[0]) * mul, bits_to_f32(w[1]) * mul, bits_to_f32(w[2]) * mul,
            bits_to_f32(w[3]) * mul)


@device_function
def _stage_quad(dst, dst_idx, src, scales, off, kind, mul):
    """dst[dst_idx : +4] = 4 source values from element off (zeros where off < 0)."""
    a, b, c, d = float32(0.0), float32(0.0), float32(0.0), float32(0.0)
    if off >= 0:
        a, b, c, d = _load_quad(src, scales, off, kind, mul)
    st_shared_v4(dst, dst_idx, a, b, c, d)


@device_function
def group_end(row_seq, base, a, n_tok):
    """End of the run of tokens [a, end) of this tile that share row a's sequence."""
    b = a + 1
    while b < n_tok and row_seq[base + b] == row_seq[base + a]:
        b += 1
    return b


@device_function
def query_rows(qrow_sh, lim_sh, n_block_rows, seq_lens, base, a, b, n_heads, kv_head, group,
               head_dim):
    """Per query row of a block of n_block_rows, for the run of tokens [a, b): offset of its q /
    out vector (-1: not live) and its number of visible keys (seq_len, 0 when not live); returns
    the run's key count."""
    tid = cuda.threadIdx.x
    if tid < n_block_rows:
        t = tid // group
        live = tid < group * (n_block_rows // group) and a <= t < b
        qrow_sh[tid] = ((base + t) * n_heads + kv_head * group + tid % group) * int64(head_dim) \
            if live else int64(-1)
        lim_sh[tid] = seq_lens[base + t] if live else 0
    kend = 0
    for t in range(a, b):
        kend = max(kend, seq_lens[base + t])
    return kend


@device_function
def _setup_group(qrow_sh, lim_sh, m_sh, l_sh, seq_lens, base, a, b, n_heads, kv_head, group,
                 head_dim):
    """query_rows for this kernel's ROWS, and their softmax state emptied."""
    tid = cuda.threadIdx.x
    if tid < ROWS:
        m_sh[tid], l_sh[tid] = float32(MASKED), float32(0.0)
    return query_rows(qrow_sh, lim_sh, ROWS, seq_lens, base, a, b, n_heads, kv_head, group,
                      head_dim)


@device_function
def _key_rows(krow_sh, block_table, table, k0, kend, block_size, n_kv, kv_head, head_dim):
    """krow_sh[j] = element offset of key k0 + j's row in the cache (-1 past kend)."""
    tid = cuda.threadIdx.x
    if tid < KT:
        key = k0 + tid
        blk = int64(block_table[table + key // block_size]) if key < kend else int64(0)
        krow_sh[tid] = ((blk * block_size + key % block_size) * n_kv + kv_head) * head_dim \
            if key < kend else int64(-1)


@device_function
def _offset(row_off, inner):
    return row_off + inner if row_off >= 0 else int64(-1)


@device_function
def _stage_qk(buf, q, qrow_sh, k_cache, k_scales, krow_sh, dc, kind, scale):
    """buf[:ROWS·QK_STRIDE] = scale·Q[:, dc:dc+DC], then K[:, dc:dc+DC] of the tile's keys."""
    for u in range(ROWS * DC // 4 // THREADS):
        i = cuda.threadIdx.x + u * THREADS
        r, dq = i // (DC // 4), i % (DC // 4)
        _stage_quad(buf, r * QK_STRIDE + 4 * dq, q, q, _offset(qrow_sh[r], dc + 4 * dq), KV_F32,
                    scale)
    for u in range(KT * DC // 4 // THREADS):
        i = cuda.threadIdx.x + u * THREADS
        j, dq = i // (DC // 4), i % (DC // 4)
        _stage_quad(buf, (ROWS + j) * QK_STRIDE + 4 * dq, k_cache, k_scales,
                    _offset(krow_sh[j], dc + 4 * dq), kind, float32(1.0))


@device_function
def _stage_v(buf, v_cache, v_scales, krow_sh, j0, kind, head_dim, vk):
    """buf[:vk·head_dim] = V rows of the tile's keys [j0, j0 + vk)."""
    for u in range(vk * head_dim // 4 // THREADS):
        i = cuda.threadIdx.x + u * THREADS
        j, dq = i // (head_dim // 4), i % (head_dim // 4)
        _stage_quad(buf, j * head_dim + 4 * dq, v_cache, v_scales,
                    _offset(krow_sh[j0 + j], 4 * dq), kind, float32(1.0))


@device_function
def _qk_chunk(s, buf, ty, tx):
    """s[4i + j] += Σ_d Q[ty + 16i, d]·K[tx + 16j, d] over the staged chunk."""
    for d in range(0, DC, 4):
        for i in range(4):
            qa, qb, qc, qd = ld_shared_v4(buf, (ty + 16 * i) * QK_STRIDE + d)
            for j in range(4):
                ka, kb, kc, kd = ld_shared_v4(buf, (ROWS + tx + 16 * j) * QK_STRIDE + d)
                s[4 * i + j] += qa * ka
                s[4 * i + j] += qb * kb  # one FMA each (a 4-term sum would add a mul and add)
                s[4 * i + j] += qc * kc
                s[4 * i + j] += qd * kd


@device_function
def _scores(s, buf, q, qrow_sh, k_cache, k_scales, krow_sh, kind, scale, head_dim, ty, tx):
    """s (4 rows, 4 keys) = scale·Q·Kᵀ of this thread's rows and keys, DC dims at a time."""
    for e in range(16):
        s[e] = float32(0.0)
    for dc in range(0, head_dim, DC):
        cuda.syncthreads()  # krow_sh is written / the previous chunk is consumed
        _stage_qk(buf, q, qrow_sh, k_cache, k_scales, krow_sh, dc, kind, scale)
        cuda.syncthreads()
        _qk_chunk(s, buf, ty, tx)


@device_function
def _mask_and_max(s, lim, red_sh, k0, ty, tx):
    """Mask keys at or past each row's seq_len; red_sh[row, tx] = max of this thread's 4 keys."""
    for i in range(4):
        part = float32(MASKED)
        for j in range(4):
            if k0 + tx + 16 * j >= lim[i]:  # causal / past the sequence
                s[4 * i + j] = float32(MASKED)
            part = max(part, s[4 * i + j])
        red_sh[(ty + 16 * i) * 16 + tx] = part


@device_function
def _update_max(row, red_sh, m_sh, ref_sh, corr_sh):
    """Row owner: new running max, the reference the tile's exps subtract and the old terms'
    rescale factor (a row with no visible key yet keeps p = 0)."""
    tile_max = red_sh[row * 16]
    for x in range(1, 16):
        tile_max = max(tile_max, red_sh[row * 16 + x])
    m_new = max(m_sh[row], tile_max)
    ref = m_new if m_new > MASKED else float32(0.0)
    corr_sh[row] = math.exp(m_sh[row] - ref)
    ref_sh[row], m_sh[row] = ref, m_new


@device_function
def _probabilities(s, ref_sh, red_sh, p_sh, ty, tx):
    """p = exp(s - ref) → p_sh (key-major); red_sh[row, tx] = Σ of this thread's 4 p."""
    for i in range(4):
        ref = ref_sh[ty + 16 * i]
        part = float32(0.0)
        for j in range(4):
            p = math.exp(s[4 * i + j] - ref)
            p_sh[(tx + 16 * j) * P_STRIDE + ty + 16 * i] = p
            part += p
        red_sh[(ty + 16 * i) * 16 + tx] = part


@device_function
def _update_sum(row, red_sh, l_sh, corr_sh):
    total = float32(0.0)
    for x in range(16):
        total += red_sh[row * 16 + x]
    l_sh[row] = l_sh[row] * corr_sh[row] + total


@device_function
def _softmax_tile(s, lim, red_sh, m_sh, l_sh, ref_sh, corr_sh, p_sh, k0, ty, tx):
    """Online-softmax step of the tile's scores: P → p_sh, per row the running max / sum in
    m_sh / l_sh and the old output's rescale factor in corr_sh (published by the last barrier)."""
    tid = cuda.threadIdx.x
    _mask_and_max(s, lim, red_sh, k0, ty, tx)
    cuda.syncthreads()
    if tid < ROWS:
        _update_max(tid, red_sh, m_sh, ref_sh, corr_sh)
    cuda.syncthreads()
    _probabilities(s, ref_sh, red_sh, p_sh, ty, tx)
    cuda.syncthreads()
    if tid < ROWS:
        _update_sum(tid, red_sh, l_sh, corr_sh)


def _pv_layout(head_dim: int) -> tuple[int, int, int, int]:
    """(lanes_per_row, quads_per_lane, rows_per_lane, vk) of the P·V step: a warp's lanes split
    head_dim / 4 quads of dims over its 8 rows; V is staged vk keys at a time."""
    quads = head_dim // 4
    lanes_per_row = min(32, quads)
    quads_per_lane = quads // lanes_per_row
    rows_per_lane = ROWS * quads // (THREADS * quads_per_lane)  # 8 rows per warp in all
    return lanes_per_row, quads_per_lane, rows_per_lane, min(KT, V_FLOATS // head_dim)


@functools.cache
def _output_accumulators(head_dim: int):
    """Device functions on a thread's O accumulators acc (rows_per_lane, quads_per_lane, 4)."""
    lanes_per_row, quads_per_lane, rows_per_lane, vk = _pv_layout(head_dim)

    @device_function
    def accumulate_pv(acc, p_sh, buf, j0, r0, lq):
        """acc[i, quad c] += Σ_j P[j0 + j, r0 + i]·V[j, 4·(lq + 32c) : +4] over the staged V."""
        for j in range(vk):
            for c in range(quads_per_lane):
                va, vb, vc, vd = ld_shared_v4(buf, j * head_dim + 4 * (lq + lanes_per_row * c))
                for i4 in range(0, rows_per_lane, 4):
                    p4 = ld_shared_v4(p_sh, (j0 + j) * P_STRIDE + r0 + i4)
                    for i in range(4):
                        e = ((i4 + i) * quads_per_lane + c) * 4  # acc index of (row, quad c)
                        acc[e] += p4[i] * va
                        acc[e + 1] += p4[i] * vb
                        acc[e + 2] += p4[i] * vc
                        acc[e + 3] += p4[i] * vd

    @device_function
    def rescale(acc, corr_sh, r0):
        for i in range(rows_per_lane):
            corr = corr_sh[r0 + i]
            for e in range(quads_per_lane * 4):
                acc[i * quads_per_lane * 4 + e] *= corr

    @device_function
    def write_out(out, acc, qrow_sh, l_sh, r0, lq):
        for i in range(rows_per_lane):
            off = qrow_sh[r0 + i]
            if off >= 0:
                inv = float32(1.0) / l_sh[r0 + i]
                for c in range(quads_per_lane):
                    for e in range(4):
                        out[off + 4 * (lq + lanes_per_row * c) + e] = \
                            acc[(i * quads_per_lane + c) * 4 + e] * inv

    return accumulate_pv, rescale, write_out


@functools.cache
def _key_tile_step(head_dim: int, kind: int):
    """attend_key_tile: one KT-key tile of a run — scores, online softmax, O += P·V."""
    vk = _pv_layout(head_dim)[3]
    accumulate_pv, rescale, _ = _output_accumulators(head_dim)

    @device_function
    def attend_key_tile(acc, s, lim, buf, p_sh, krow_sh, red_sh, qrow_sh, softmax_sh, q, kv,
                        scales, block_table, table, k0, kend, block_size, n_kv, kv_head, scale,
                        thread):
        """acc (this thread's O rows) += the tile's P·V; softmax_sh = (m, l, ref, corr) rows;
        kv, scales = (K, V) caches and their scales; thread = (ty, tx, r0, lq)."""
        m_sh, l_sh, ref_sh, corr_sh = softmax_sh
        ty, tx, r0, lq = thread
        cuda.syncthreads()  # the previous tile is done with krow_sh
        _key_rows(krow_sh, block_table, table, k0, kend, block_size, n_kv, kv_head, head_dim)
        _scores(s, buf, q, qrow_sh, kv[0], scales[0], krow_sh, kind, scale, head_dim, ty, tx)
        _softmax_tile(s, lim, red_sh, m_sh, l_sh, ref_sh, corr_sh, p_sh, k0, ty, tx)
        rescale(acc, corr_sh, r0)
        for j0 in range(0, min(KT, kend - k0), vk):
            if j0 > 0:
                cuda.syncthreads()  # the previous V sub-tile is consumed
            _stage_v(buf, kv[1], scales[1], krow_sh, j0, kind, head_dim, vk)
            cuda.syncthreads()
            accumulate_pv(acc, p_sh, buf, j0, r0, lq)

    return attend_key_tile


@functools.cache
def _prefill_kernel(head_dim: int, kind: int):
    lanes_per_row, quads_per_lane, rows_per_lane, _ = _pv_layout(head_dim)
    n_acc = rows_per_lane * quads_per_lane * 4
    attend_key_tile = _key_tile_step(head_dim, kind)
    write_out = _output_accumulators(head_dim)[2]

    @kernel(fastmath=True)
    def prefill(q, k_cache, v_cache, k_scales, v_scales, block_table, max_blocks, row_seq,
                seq_lens, n_rows, n_kv, block_size, scale, out):
        chain_start()
        n_heads = q.size // (n_rows * head_dim)
        group = n_heads // n_kv
        base = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * (ROWS // group)  # longest tiles first
        n_tok, kv_head = min(ROWS // group, n_rows - base), cuda.blockIdx.y
        tid = cuda.threadIdx.x
        ty, tx = tid // 16, tid % 16
        r0 = (tid // 32) * 8 + (tid % 32) // lanes_per_row * rows_per_lane
        lq = tid % lanes_per_row
        buf = cuda.shared.array(BUF_FLOATS, float32, alignment=SMEM_ALIGN)  # Q|K chunk or V
        p_sh = cuda.shared.array(P_FLOATS, float32, alignment=SMEM_ALIGN)  # (KT, P_STRIDE)
        krow_sh = cuda.shared.array(KT, int64)
        red_sh = cuda.shared.array(RED_FLOATS, float32)  # (ROWS, 16)
        qrow_sh = cuda.shared.array(ROWS, int64)
        lim_sh = cuda.shared.array(ROWS, int32)
        m_sh = cuda.shared.array(ROWS, float32)
        l_sh = cuda.shared.array(ROWS, float32)
        softmax_sh = (m_sh, l_sh, cuda.shared.array(ROWS, float32),
                      cuda.shared.array(ROWS, float32))  # running max, sum; ref, corr
        s = cuda.local.array(16, float32)  # (4 rows, 4 keys) of S
        lim = cuda.local.array(4, int32)
        acc = cuda.local.array(n_acc, float32)  # (rows_per_lane, quads_per_lane, 4) of O
        a = 0
        while a < n_tok:
            b = group_end(row_seq, base, a, n_tok)
            cuda.syncthreads()  # the previous run is done with the row arrays
            kend = _setup_group(qrow_sh, lim_sh, m_sh, l_sh, seq_lens, base, a, b, n_heads,
                                kv_head, group, head_dim)
            table = row_seq[base + a] * max_blocks
            cuda.syncthreads()
            for i in range(4):
                lim[i] = lim_sh[ty + 16 * i]
            for e in range(n_acc):
                acc[e] = float32(0.0)
            for k0 in range(0, kend, KT):
                attend_key_tile(acc, s, lim, buf, p_sh, krow_sh, red_sh, qrow_sh, softmax_sh, q,
                                (k_cache, v_cache), (k_scales, v_scales), block_table, table, k0,
                                kend, block_size, n_kv, kv_head, scale, (ty, tx, r0, lq))
            cuda.syncthreads()  # l_sh is final
            write_out(out, acc, qrow_sh, l_sh, r0, lq)
            a = b
    return prefill


def prefill_attention(q, k_cache, v_cache, block_table, seq_lens, out, scale: float | None = None,
                      stream=0, row_seq=None, scales=None) -> None:
    """q (n_rows, n_heads, head_dim) f32: row r attends causally to the first seq_lens[r] cached
    tokens of block-table row row_seq[r] → out (n_rows, n_heads, head_dim) f32.

    paged_decode_attention's inputs for a multi-token pass (no split workspace): seq_lens[r] =
    position + 1, the rows of one sequence consecutive (they then share K/V tiles), their K/V
    already in the cache. row_seq defaults to row r → table row r. scales: (k_scales, v_scales)
    f32, one per 32 cached values, for int8 caches. head_dim 64, 128 or 256; n_heads / n_kv ≤ 64.
    """
    n_rows, n_heads, head_dim = q.shape
    _, block_size, n_kv, _ = k_cache.shape
    row_seq, scale = checked_inputs(q, k_cache, v_cache, block_table, seq_lens, out, row_seq,
                                    scale)
    kind = kv_kind(k_cache)
    k_scales, v_scales = flat_scales(kind, scales, k_cache.size)
    grid = (cdiv(n_rows, ROWS // (n_heads // n_kv)), n_kv)
    _prefill_kernel(head_dim, kind)[grid, THREADS, stream](
        q.reshape(q.size), k_cache.reshape(k_cache.size), v_cache.reshape(v_cache.size),
        k_scales, v_scales, block_table.reshape(block_table.size), block_table.shape[1], row_seq,
        seq_lens, n_rows, n_kv, block_size, float32(scale), out.reshape(out.size))


def supports(n_heads: int, n_kv: int, head_dim: int) -> bool:
    """Whether this kernel takes the model's attention shape (else use paged_decode_attention)."""
    return head_dim in HEAD_DIMS and n_heads % n_kv == 0 and n_heads // n_kv <= ROWS


def checked_inputs(q, k_cache, v_cache, block_table, seq_lens, out, row_seq, scale):
    """Check a prefill attention call's arrays; returns its row_seq (default: row r → table row
    r) and scale (default 1 / √head_dim)."""
    n_rows, _, head_dim = q.shape
    _check_shapes(q, k_cache, v_cache, out)
    check_array("block_table", block_table, np.int32)
    check_array("seq_lens", seq_lens, np.int32, (n_rows,))
    if row_seq is None:
        if block_table.shape[0] != n_rows:
            raise ValueError("block_table needs one row per query row when row_seq is not given")
        row_seq = cuda.to_device(np.arange(n_rows, dtype=np.int32))  # (n_rows,)
    check_array("row_seq", row_seq, np.int32, (n_rows,))
    return row_seq, 1.0 / math.sqrt(head_dim) if scale is None else scale


def _check_shapes(q, k_cache, v_cache, out) -> None:
    if q.ndim != 3 or k_cache.ndim != 4:
        raise ValueError(f"q {q.shape} must be (rows, heads, head_dim), the cache "
                         f"{k_cache.shape} (blocks, block_size, kv_heads, head_dim)")
    n_rows, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[2]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim}: prefill attention supports {HEAD_DIMS}")
    if tuple(v_cache.shape) != tuple(k_cache.shape) or k_cache.shape[3] != head_dim:
        raise ValueError(f"K/V caches {k_cache.shape} / {v_cache.shape} do not match q's "
                         f"head_dim {head_dim}")
    if n_heads % n_kv or n_heads // n_kv > ROWS:
        raise ValueError(f"{n_heads} q heads over {n_kv} kv heads: need n_heads % n_kv == 0 "
                         f"and at most {ROWS} q heads per kv head")
    if np.dtype(v_cache.dtype) != np.dtype(k_cache.dtype):
        raise ValueError(f"K cache {k_cache.dtype} and V cache {v_cache.dtype} differ")
    check_array("q", q, np.float32)
    check_array("out", out, np.float32, q.shape)
