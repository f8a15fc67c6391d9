"""The gated delta rule over whole chunks of a sequence's tokens (the WY form) on tensor cores.

The token-by-token kernel (gated_delta.delta_seq) advances the state one token at a time: every
token is a chain of dependent dot products and shuffles. Here the tokens go C at a time (the math
of the CPU reference `kernels/cpu/gated_delta.gated_delta_chunked`, with Sᵀ[j][i] the state of
value column j): with G_c a chunk's cumulative log-decay up to token c and S₀ the state before it,

    A[c][c'] = β_c e^(G_c − G_c') k_c·k_c'  (c' < c)    P[c][c'] = e^(G_c − G_c') q_c·k_c' (c' ≤ c)
    T = (I + A)⁻¹    W = T·(β e^G K)    U = T·(β V)        (none of these depends on S₀)
    V' = U − W·S₀    o_c = e^(G_c) S₀ q_c + Σ_c' P[c][c'] V'[c']
    Sᵀ = e^(G_last) S₀ᵀ + V'ᵀ K̃,  k̃_c = e^(G_last − G_c) k_c

Two kernels, as the fast public implementations split it (docs/gated-deltanet-prefill.md): the
first (`chunk_prep`) computes G, P, T, W and U for every chunk of every sequence and value head at
once, in parallel, into a scratch buffer; the second (`chunk_recur`) carries the state across a
sequence's chunks — the only sequential part, three products a chunk: [W; Q]·S₀, P·V' and V'ᵀ·K̃.
Every product runs on mma.sync m16n8k16 over f16 operands staged in shared memory, with float32
sums; the state itself stays float32 (only its copy as an operand is rounded), as in the public
kernels (FLA and vLLM/SGLang use bf16 operands): the projections that make q, k and v already
multiply f16 activations. A recurrence block keeps its COLS value columns of Sᵀ in its
warps' accumulator registers over the whole sequence. Both kernels copy a chunk's float32 rows
into shared memory with cp.async and stage the operands from there, so that no thread waits on one
global load before issuing the next; each walks its chunks with the next one's copies in flight.

Inputs are prepared (gated_delta's prepare step with log_decay): q, k L2-normalised (q also
/ sqrt(dk)), a the log-decay, b the β. Opt-in (SPARKINFER_GDN_CHUNKED) until measured faster than
the token kernel on the GPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, float32, uint32

from sparkinfer_cli.kernels.cuda.mma_fragments import mma_into
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import (
    chain_start,
    cp_async_16,
    cp_async_commit,
    cp_async_wait,
    f16_bits_to_f32,
    pack_f16x2,
)
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv, check_array, multiprocessors
from sparkinfer_cli.kernels.cuda.runtime.warp import shfl_xor

CHUNK = 32  # tokens a chunk (two k16 steps of the P·V' and update products)
WARPS = 8
THREADS = 32 * WARPS
COLS = 32  # value columns a recurrence block takes (where dv is a multiple)
SEQ_BLOCKS = 64  # recurrence grid rows; block row y runs sequence entries y, y + 64, …
MAX_DK = 128  # shared memory: a chunk's rows as f16 planes, under 227 KiB
ROW_PAD = 8  # halves padding a staged row: a fragment load's 8 rows × 4 words hit 32 banks
MAX_SHARED_BYTES = 227 * 1024  # a block's shared memory on sm_90
# chunk_prep: two blocks an SM (under 114 KB of shared memory and 128 registers a thread each), so
# that one's barriers and inverse are covered by the other's work. chunk_recur keeps what it
# needs (~200): a long prompt's recurrence has a block an SM anyway (value heads × column parts)
PREP_BLOCKS_PER_SM = 2
PREP_MAX_REGISTERS = 128


def supports(dk: int, dv: int) -> bool:
    """Whether the chunked kernels take heads of this size."""
    return dk % 16 == 0 and dk <= MAX_DK and dv % 16 == 0 and dv <= 128


def scratch_cols(dk: int, dv: int, chunk: int = CHUNK) -> int:
    """Floats a (row, value head) of the scratch buffer holds: W's row, U's, P's and G, padded
    to whole 16-byte pieces (chunk_recur copies them in so)."""
    return dk + dv + chunk + 4


def chunk_list(seq_lo: np.ndarray, seq_n: np.ndarray, out_lo: np.ndarray, out_n: np.ndarray,
               chunk: int = CHUNK) -> None:
    """The pass's chunks, each sequence's in order (host): out_lo[i], out_n[i] = first row and
    rows of chunk i, −1 and 0 past the last (out_*: at least Σ⌈seq_n / chunk⌉ entries)."""
    n_chunks = -(-seq_n // chunk)  # per sequence entry
    seq = np.repeat(np.arange(len(seq_n)), n_chunks)
    k = np.arange(len(seq)) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
    out_lo[:len(seq)], out_lo[len(seq):] = seq_lo[seq] + k * chunk, -1
    out_n[:len(seq)], out_n[len(seq):] = np.minimum(chunk, seq_n[seq] - k * chunk), 0


@dataclass
class ChunkedPass:
    """What the chunked kernels need beside the delta rule's arguments (device arrays):
    scratch (n_rows, H_v, scratch_cols(dk, dv, chunk)) float32 holds each chunk's W, U, P and G
    between the two kernels; chunk_lo, chunk_n (n_rows,) int32: chunk_list's."""
    scratch: Any
    chunk_lo: Any
    chunk_n: Any


def _cols(dv: int) -> int:
    """Value columns a recurrence block takes."""
    return COLS if dv % COLS == 0 else dv


@functools.cache
def _layout(planes: tuple[tuple[str, int, int], ...],
            floats: tuple[tuple[str, int], ...]) -> dict[str, int]:
    """Word offsets of a block's shared memory: f16 planes (at `name`, rows of `name_w` words) of
    (name, rows, halves a row), then float32 arrays (name, size), each 16-byte aligned; `words`
    in all."""
    at, out = 0, {}
    for name, rows, cols in planes:
        w = (cols + ROW_PAD) // 2
        out[name], out[name + "_w"] = at, w
        at += rows * w
    for name, size in floats:
        at = -(-at // 4) * 4  # 16-byte aligned: cp.async writes the raw rows
        out[name] = at
        at += size
    out["words"] = at
    return out


def _prep_layout(dk: int, dv: int, C: int) -> dict[str, int]:
    """chunk_prep's: k | q rows, [β e^G K | β V]ᵀ, what f16 lost of β Vᵀ, and T planes; A, G and
    β; the raw float32 rows k | q | v of a chunk as they arrive."""
    return _layout((("kq", 2 * C, dk), ("bkv", dk + dv, C), ("bv_lo", dv, C), ("tt", C, C)),
                   (("am", C * C), ("g", C), ("beta", C), ("raw", C * (2 * dk + dv))))


def _recur_layout(dk: int, dvp: int, C: int) -> dict[str, int]:
    """chunk_recur's: W | Q rows, K̃ᵀ, Sᵀ, V'ᵀ and P planes; X = [W; Q]·S₀, U and G; the raw
    float32 rows of a chunk as they arrive (_raw_row)."""
    return _layout((("kq", 2 * C, dk), ("kt", dk, C), ("st", dvp, dk), ("dt", dvp, C),
                    ("pp", C, C)),
                   (("x", 2 * C * dvp), ("uu", C * dvp), ("g", C),
                    ("raw", C * _raw_row(dk, dvp, C))))


def _raw_row(dk: int, dvp: int, C: int) -> int:
    """Floats of a chunk row as chunk_recur copies it in: W | q | k | P | U's columns | G and
    three floats of padding (whole 16-byte pieces)."""
    return 3 * dk + C + dvp + 4


def _plane(layout: dict[str, int], name: str) -> tuple[int, int]:
    """(first word, words a row) of one of a layout's f16 planes."""
    return layout[name], layout[name + "_w"]


def _warp_share(row_tiles: int, col_tiles: int) -> tuple[int, int]:
    """(tiles a warp, accumulators a lane) of a product of row_tiles × col_tiles mma tiles."""
    per_warp = -(-row_tiles * col_tiles // WARPS)
    return per_warp, 4 * per_warp


@device_function
def _put_pair(smw, at, x, y):
    """A word of an f16 plane ← floats x, y (its two halves)."""
    smw[uint32(at)] = pack_f16x2(x, y)


@device_function
def _frag_a(smw, at, w, row0, kw):
    """A fragment (16 × 16, row-major, k contiguous) of rows row0.. from word kw of each row."""
    lane = cuda.threadIdx.x & 31
    top = uint32(at + (row0 + (lane >> 2)) * w + kw + (lane & 3))
    bottom = uint32(top + 8 * w)
    return smw[top], smw[bottom], smw[uint32(top + 4)], smw[uint32(bottom + 4)]


@device_function
def _frag_b(smw, at, w, n0, kw):
    """B fragment (16 × 8) from Bᵀ rows n0.. (k contiguous) from word kw of each row."""
    lane = cuda.threadIdx.x & 31
    i = uint32(at + (n0 + (lane >> 2)) * w + kw + (lane & 3))
    return smw[i], smw[uint32(i + 4)]


@device_function(numba_inline=True)
def _mma(acc, i, a, smw, b_at, bw, n0, kw):
    """acc[i..i+3] += A·B for one m16n8k16 tile, A its fragment (_frag_a) and B the plane at
    b_at."""
    b0, b1 = _frag_b(smw, b_at, bw, n0, kw)
    mma_into(acc, i, a, b0, b1)


@device_function
def _tile_element(row0, n0, e):
    """(row, column) of accumulator element e (0..3) of this lane in the tile at (row0, n0)."""
    lane = cuda.threadIdx.x & 31
    return row0 + (lane >> 2) + 8 * (e >> 1), n0 + 2 * (lane & 3) + (e & 1)


@device_function
def _scratch_at(dest, c):
    """Index in the scratch buffer of the (row, value head) of chunk row c; dest = (first row,
    rows, value head, value heads, floats a (row, head))."""
    return ((dest[0] + c) * dest[3] + dest[2]) * dest[4]


def _row_stager(n_plane: int, cols: int, C: int, pair):
    """stage(smw, plane, n_c, args): the f16 plane (first word, words a row) of an n_plane × cols
    matrix whose row `row` is chunk row c = row % C; (M[row][col], M[row][col + 1]) =
    pair(args, row, c, col) for c < n_c, zero past them. A fixed count of loads a thread, so
    that they all go out at once."""
    half = cols // 2

    @device_function
    def stage(smw, plane, n_c, args):
        at, w = plane
        for q in range(-(-n_plane * half // THREADS)):
            e = uint32(cuda.threadIdx.x + q * THREADS)
            row, wd = e // half, e % half
            x, y = float32(0.0), float32(0.0)
            if row % C < n_c and row < n_plane:
                x, y = pair(args, row, row % C, 2 * wd)
            if row < n_plane:
                _put_pair(smw, at + row * w + wd, x, y)
    return stage


def _transposed_stager(n_plane: int, C: int, value, remainder: tuple[int, int, int] | None = None):
    """stage(smw, plane, n_c, args): the f16 plane (first word, words a row) of an n_plane × C
    matrix Mᵀ, Mᵀ[i][c] = value(args, c, i) for rows c < n_c, zero past them; a thread a pair of
    rows of one i, i fastest (a warp reads a token row's consecutive floats). remainder = (first
    row, plane's first word, words a row): rows from the first on also put what f16 lost of them
    in that plane (row i at i − first), so that hi + lo carries them at about float32's
    precision."""
    half_c = C // 2
    lo_from, lo_at, lo_w = remainder or (n_plane, 0, 0)  # (n_plane, …): no row has one

    @device_function
    def stage(smw, plane, n_c, args):
        at, w = plane
        for q in range(-(-n_plane * half_c // THREADS)):
            e = uint32(cuda.threadIdx.x + q * THREADS)
            cw, i = e // n_plane, e % n_plane
            xy = cuda.local.array(2, float32)
            for m in range(2):
                xy[m] = float32(0.0)
                if 2 * cw + m < n_c and cw < half_c:
                    xy[m] = value(args, 2 * cw + m, i)
            if cw < half_c:
                h = pack_f16x2(xy[0], xy[1])
                smw[uint32(at + i * w + cw)] = h
                if i >= lo_from:
                    smw[uint32(lo_at + (i - lo_from) * lo_w + cw)] = pack_f16x2(
                        xy[0] - f16_bits_to_f32(h & 0xFFFF), xy[1] - f16_bits_to_f32(h >> 16))
    return stage


@functools.cache
def _prep_copy_fn(dk: int, dv: int, C: int):
    """copy(u, smf, offs, dest): start the copies of a chunk's rows < n_c (k | q | v, 16 bytes
    a cp.async) into the raw rows."""
    raw, rs = _prep_layout(dk, dv, C)["raw"], 2 * dk + dv
    pieces, k4 = rs // 4, dk // 4

    @device_function
    def copy(u, smf, offs, dest):
        u_stride, q_off, k_off, v_off = offs
        for e in range(cuda.threadIdx.x, C * pieces, THREADS):
            c, p = uint32(e) // pieces, uint32(e) % pieces
            if c < dest[1]:
                col = k_off + 4 * p if p < k4 else \
                    q_off + 4 * (p - k4) if p < 2 * k4 else v_off + 4 * (p - 2 * k4)
                src = (dest[0] + c) * u_stride + col
                cp_async_16(smf, 4 * (raw + c * rs + 4 * p), u, 4 * src)
    return copy


@device_function
def _gates(a, b, dest):
    """The log-decay and β of this thread's chunk row (threads < n_c; zero for the others)."""
    c = cuda.threadIdx.x
    if c < dest[1]:
        i = (dest[0] + c) * dest[3] + dest[2]
        return a[uint32(i)], b[uint32(i)]
    return float32(0.0), float32(0.0)


@functools.cache
def _prep_stage_fn(dk: int, dv: int, C: int):
    L = _prep_layout(dk, dv, C)
    kq, bkv = _plane(L, "kq"), _plane(L, "bkv")
    g_at, b_at, g_col, raw, rs = L["g"], L["beta"], dk + dv + C, L["raw"], 2 * dk + dv

    @device_function
    def kq_pair(smf, row, c, col):
        """k_c (rows < C) or q_c (the next C) at columns col, col + 1."""
        at = uint32(raw + c * rs + (dk if row >= C else 0) + col)
        return smf[at], smf[at + 1]

    stage_kq = _row_stager(2 * C, dk, C, kq_pair)

    @device_function
    def bkv_value(smf, c, i):
        """[β e^G K | β V][c][i] (a raw row: k | q | v)."""
        scale = smf[uint32(b_at + c)] * (math.exp(smf[uint32(g_at + c)]) if i < dk else
                                         float32(1.0))
        return scale * smf[uint32(raw + c * rs + (i if i < dk else dk + i))]

    # β V in two planes: where keys repeat within a chunk, T's rows cancel most of T·βV's terms,
    # and from f16 values alone U (and through it the state) keeps their rounding
    # (bench/probes/gdn_rounding_emulation.py)
    stage_bkv = _transposed_stager(dk + dv, C, bkv_value, (dk, *_plane(L, "bv_lo")))

    @device_function
    def stage(smw, smf, dest, gates, scratch):
        """The chunk's planes from its raw rows and gates (rows past n_c zero: they neither decay
        nor write): k | q rows, G (the log-decays summed over the chunk, also to the scratch), β
        and [β e^G K | β V]ᵀ."""
        n_c, tid = dest[1], cuda.threadIdx.x
        stage_kq(smw, kq, n_c, smf)
        if tid < C:
            smf[uint32(g_at + tid)], smf[uint32(b_at + tid)] = gates
        cuda.syncthreads()
        if tid == 0:
            for c in range(1, C):
                smf[uint32(g_at + c)] += smf[uint32(g_at + c - 1)]
        cuda.syncthreads()
        if tid < n_c:
            scratch[uint32(_scratch_at(dest, tid) + g_col)] = smf[uint32(g_at + tid)]
        stage_bkv(smw, bkv, n_c, smf)
    return stage


@functools.cache
def _token_products_fn(dk: int, dv: int, C: int):
    """token_products: A (float32 in shared memory, strictly lower) and P (to the scratch, lower
    with the diagonal) from [K; Q]·Kᵀ: a warp per 16 rows × 16 columns of the 2C × C product."""
    L = _prep_layout(dk, dv, C)
    kq, kq_w = _plane(L, "kq")
    am, g_at, b_at, p_col = L["am"], L["g"], L["beta"], dk + dv
    tiles = (2 * C // 16) * (C // 16)  # warp tiles of 16 × 16

    @device_function
    def masked(smf, row, c2, v):
        """A[row][c2] (row < C) or P[row − C][c2] from its dot product v."""
        c = row if row < C else row - C
        if c2 > c or (row < C and c2 == c):
            return float32(0.0)
        v *= math.exp(smf[uint32(g_at + c)] - smf[uint32(g_at + c2)])
        return v * smf[uint32(b_at + c)] if row < C else v

    @device_function
    def token_products(smw, smf, scratch, dest):
        warp = cuda.threadIdx.x >> 5
        for t in range(warp, tiles, WARPS):
            row0, n0 = 16 * (t // (C // 16)), 16 * (t % (C // 16))
            acc = cuda.local.array(8, float32)
            for i in range(8):
                acc[i] = 0.0
            for kw in range(0, dk // 2, 8):
                a = _frag_a(smw, kq, kq_w, row0, kw)
                for nt in range(2):
                    _mma(acc, 4 * nt, a, smw, kq, kq_w, n0 + 8 * nt, kw)
            for nt in range(2):
                for e in range(4):
                    row, c2 = _tile_element(row0, n0 + 8 * nt, e)
                    v = masked(smf, row, c2, acc[4 * nt + e])
                    if row < C:
                        smf[uint32(am + row * C + c2)] = v
                    elif row - C < dest[1]:
                        scratch[uint32(_scratch_at(dest, row - C) + p_col + c2)] = v
    return token_products


@functools.cache
def _wy_fn(dk: int, dv: int, C: int):
    """wy: [W | U] = T·[β e^G K | β V] (C × (dk + dv)) to the scratch, 16 × 8 tiles over the
    warps; U's tiles also take T times β V's remainder plane."""
    L = _prep_layout(dk, dv, C)
    tt, tt_w = _plane(L, "tt")
    bkv, bkv_w = _plane(L, "bkv")
    bv_lo, bv_lo_w = _plane(L, "bv_lo")
    row_tiles, tiles = C // 16, (C // 16) * ((dk + dv) // 8)

    @device_function
    def wy(smw, scratch, dest):
        warp = cuda.threadIdx.x >> 5
        for t in range(warp, tiles, WARPS):
            row0, n0 = 16 * (t % row_tiles), 8 * (t // row_tiles)
            acc = cuda.local.array(4, float32)
            for i in range(4):
                acc[i] = 0.0
            for kw in range(0, C // 2, 8):
                a = _frag_a(smw, tt, tt_w, row0, kw)
                _mma(acc, 0, a, smw, bkv, bkv_w, n0, kw)
                if n0 >= dk:
                    _mma(acc, 0, a, smw, bv_lo, bv_lo_w, n0 - dk, kw)
            for e in range(4):
                c, n = _tile_element(row0, n0, e)
                if c < dest[1]:
                    scratch[uint32(_scratch_at(dest, c) + n)] = acc[e]
    return wy


@functools.cache
def _prep_kernel(dk: int, dv: int, C: int):
    """chunk_prep: a block per value head and chunks y, y + grid rows, … of the pass's list."""
    L = _prep_layout(dk, dv, C)
    copy, stage = _prep_copy_fn(dk, dv, C), _prep_stage_fn(dk, dv, C)
    token_products = _token_products_fn(dk, dv, C)
    invert = _inverse_fn(C, L["am"], *_plane(L, "tt"))
    wy = _wy_fn(dk, dv, C)
    n_scratch = scratch_cols(dk, dv, C)

    @kernel(fastmath=True, max_registers=PREP_MAX_REGISTERS)
    def chunk_prep(u, a, b, chunk_lo, chunk_n, n_k_heads, head_map_mod, scratch):
        chain_start()
        h, n_v_heads, i = cuda.blockIdx.x, cuda.gridDim.x, cuda.blockIdx.y
        smw = cuda.shared.array(0, uint32)  # f16 planes (_prep_layout)
        smf = cuda.shared.array(0, float32)  # the same memory: the float32 part
        kh = h % n_k_heads if head_map_mod else h // (n_v_heads // n_k_heads)
        key_dim = n_k_heads * dk
        offs = (2 * key_dim + n_v_heads * dv, kh * dk, key_dim + kh * dk, 2 * key_dim + h * dv)
        if i >= chunk_lo.size or chunk_lo[i] < 0:
            return
        dest = (chunk_lo[i], chunk_n[i], h, n_v_heads, n_scratch)
        copy(u, smf, offs, dest)
        cp_async_commit()
        gates = _gates(a, b, dest)
        while True:
            cp_async_wait(0)
            cuda.syncthreads()
            stage(smw, smf, dest, gates, scratch)
            cuda.syncthreads()  # the raw rows are free: the block's next chunk's copies go out
            i += cuda.gridDim.y
            more = i < chunk_lo.size and chunk_lo[i] >= 0
            follow, next_gates = dest, gates
            if more:
                follow = (chunk_lo[i], chunk_n[i], h, n_v_heads, n_scratch)
                copy(u, smf, offs, follow)
                cp_async_commit()
                next_gates = _gates(a, b, follow)
            token_products(smw, smf, scratch, dest)
            cuda.syncthreads()
            invert(smw, smf)
            cuda.syncthreads()
            wy(smw, scratch, dest)
            cuda.syncthreads()  # before the next chunk's staging overwrites shared memory
            if not more:
                return
            dest, gates = follow, next_gates
    return chunk_prep


@functools.cache
def _inverse_fn(C: int, am: int, tt: int, tt_w: int):
    """invert(smw, smf): T = (I + A)⁻¹ (A strictly lower, float32 at word am) into T's f16 planes
    (rows c, k = c' contiguous), thread c' computing column c' in registers: once T[c2]
    is final, A[c][c2]·T[c2] leaves every row c below it, so the critical path is C dependent
    multiply-adds. The C(C − 1)/2 of them are written out here (generated source): a loop nest
    that size is left rolled by LLVM, which would put the column in local memory."""
    body = [f"    t{c} = float32(1.0) if col == {c} else float32(0.0)" for c in range(C)]
    for c2 in range(C - 1):
        body += [f"    t{c} -= smf[{am + c * C + c2}] * t{c2}" for c in range(c2 + 1, C)]
    body += [f"    pair(smw, {c}, col, t{c})" for c in range(C)]
    source = "def column(smw, smf, col):\n" + "\n".join(body) + "\n"
    namespace = {"__name__": __name__, "float32": float32, "pair": _pair_fn(C, tt, tt_w)}
    exec(compile(source, f"<gated_delta_chunked inverse C={C}>", "exec"), namespace)
    column = device_function(namespace["column"])
    n_threads = 32 * cdiv(C, 32)  # whole warps: pair() shuffles

    @device_function
    def invert(smw, smf):
        if cuda.threadIdx.x < n_threads:
            column(smw, smf, cuda.threadIdx.x)
    return invert


@functools.cache
def _pair_fn(C: int, tt: int, tt_w: int):
    @device_function
    def pair(smw, c, col, v):
        """T[c][col] and T[c][col + 1] (from the next lane) into a word of T's planes."""
        right = shfl_xor(v, 1)
        if col < C and col % 2 == 0:
            _put_pair(smw, tt + c * tt_w + col // 2, v, right)
    return pair


@functools.cache
def _state_products_fn(dk: int, dvp: int, C: int):
    """state_products: X = [K; Q]·S₀ (2C × dvp, float32), 16 × 8 tiles spread over the warps
    (a warp keeps one row tile: its A fragments serve all its column tiles)."""
    L = _recur_layout(dk, dvp, C)
    kq, kq_w = _plane(L, "kq")
    st, st_w = _plane(L, "st")
    x_at = L["x"]
    row_tiles, col_tiles = 2 * C // 16, dvp // 8
    per_warp = _warp_share(row_tiles, col_tiles)[0]
    group = min(per_warp, 2)  # column tiles a k walk (registers: the wide kernel holds Sᵀ too)
    n_acc = 4 * group  # accumulators a lane

    @device_function
    def state_products(smw, smf):
        warp = cuda.threadIdx.x >> 5
        row0 = 16 * (warp % row_tiles)
        for q0 in range(0, per_warp, group):
            acc = cuda.local.array(n_acc, float32)
            for i in range(n_acc):
                acc[i] = 0.0
            for kw in range(0, dk // 2, 8):
                a = _frag_a(smw, kq, kq_w, row0, kw)
                for q in range(group):
                    t = warp + WARPS * (q0 + q)
                    if t < row_tiles * col_tiles:
                        _mma(acc, 4 * q, a, smw, st, st_w, 8 * (t // row_tiles), kw)
            for q in range(group):
                t = warp + WARPS * (q0 + q)
                if t < row_tiles * col_tiles:
                    for e in range(4):
                        row, j = _tile_element(row0, 8 * (t // row_tiles), e)
                        smf[uint32(x_at + row * dvp + j)] = acc[4 * q + e]
    return state_products


@functools.cache
def _outputs_fn(dk: int, dvp: int, C: int):
    """outputs: o = e^G S₀q + P·V' for the chunk's rows < n_c, 16 × 8 tiles over the warps."""
    L = _recur_layout(dk, dvp, C)
    pp, pp_w = _plane(L, "pp")
    dt, dt_w = _plane(L, "dt")
    x_at, g_at = L["x"], L["g"]
    row_tiles, col_tiles = C // 16, dvp // 8
    per_warp, n_acc = _warp_share(row_tiles, col_tiles)

    @device_function
    def outputs(smw, smf, out, r, n_c, o_row, o_base):
        warp = cuda.threadIdx.x >> 5
        row0 = 16 * (warp % row_tiles)
        acc = cuda.local.array(n_acc, float32)
        for q in range(per_warp):
            t = warp + WARPS * q
            for e in range(4):
                c, j = _tile_element(row0, 8 * (t // row_tiles), e)
                acc[4 * q + e] = float32(0.0)
                if t < row_tiles * col_tiles:
                    acc[4 * q + e] = math.exp(smf[uint32(g_at + c)]) * \
                        smf[uint32(x_at + (C + c) * dvp + j)]
        for kw in range(0, C // 2, 8):
            a = _frag_a(smw, pp, pp_w, row0, kw)
            for q in range(per_warp):
                t = warp + WARPS * q
                if t < row_tiles * col_tiles:
                    _mma(acc, 4 * q, a, smw, dt, dt_w, 8 * (t // row_tiles), kw)
        for q in range(per_warp):
            t = warp + WARPS * q
            for e in range(4):
                c, j = _tile_element(row0, 8 * (t // row_tiles), e)
                if t < row_tiles * col_tiles and c < n_c:
                    out[uint32((r + c) * o_row + o_base + j)] = acc[4 * q + e]
    return outputs


@functools.cache
def _state_fns(dk: int, dvp: int, C: int):
    """The block's part of Sᵀ (dvp × dk) lives in its warps' accumulators: 16 × 8 tiles, a warp
    keeping one row tile of value columns. Returns (accumulators a lane, load, update, store)."""
    L = _recur_layout(dk, dvp, C)
    st, st_w = _plane(L, "st")
    dt, dt_w = _plane(L, "dt")
    kt, kt_w = _plane(L, "kt")
    g_at, row_tiles, col_tiles = L["g"], dvp // 16, dk // 8
    per_warp, n_acc = _warp_share(row_tiles, col_tiles)

    @device_function(numba_inline=True)  # s: the kernel's registers
    def to_planes(smw, s):
        """Sᵀ's f16 planes (the B operand of the next chunk's state products) ← s."""
        warp = cuda.threadIdx.x >> 5
        for q in range(per_warp):
            t = warp + WARPS * q
            if t < row_tiles * col_tiles:
                for e in range(0, 4, 2):
                    j, i = _tile_element(16 * (warp % row_tiles), 8 * (t // row_tiles), e)
                    wd = j * st_w + i // 2
                    _put_pair(smw, st + wd, s[4 * q + e], s[4 * q + e + 1])

    @device_function(numba_inline=True)  # s: the kernel's registers
    def load(state, base, smw, s):
        """s ← the part's Sᵀ (global S[j][i], i contiguous) and its planes; idle tiles zero."""
        warp = cuda.threadIdx.x >> 5
        for q in range(per_warp):
            t = warp + WARPS * q
            for e in range(4):
                s[4 * q + e] = float32(0.0)
                if t < row_tiles * col_tiles:
                    j, i = _tile_element(16 * (warp % row_tiles), 8 * (t // row_tiles), e)
                    s[4 * q + e] = state[uint32(base + j * dk + i)]
        to_planes(smw, s)

    @device_function(numba_inline=True)  # s: the kernel's registers
    def update(smw, smf, s):
        """Sᵀ ← e^(G_last) Sᵀ + V'ᵀ·K̃ (V'ᵀ in the planes named dt)."""
        warp = cuda.threadIdx.x >> 5
        decay = math.exp(smf[uint32(g_at + C - 1)])
        for i in range(n_acc):
            s[i] *= decay
        for kw in range(0, C // 2, 8):
            a = _frag_a(smw, dt, dt_w, 16 * (warp % row_tiles), kw)
            for q in range(per_warp):
                t = warp + WARPS * q
                if t < row_tiles * col_tiles:
                    _mma(s, 4 * q, a, smw, kt, kt_w, 8 * (t // row_tiles), kw)
        to_planes(smw, s)

    @device_function(numba_inline=True)  # s: the kernel's registers
    def store(state, base, s):
        warp = cuda.threadIdx.x >> 5
        for q in range(per_warp):
            t = warp + WARPS * q
            if t < row_tiles * col_tiles:
                for e in range(4):
                    j, i = _tile_element(16 * (warp % row_tiles), 8 * (t // row_tiles), e)
                    state[uint32(base + j * dk + i)] = s[4 * q + e]
    return n_acc, load, update, store


@functools.cache
def _recur_copy_fn(dk: int, dv: int, dvp: int, C: int):
    """copy(u, scratch, smf, offs, dest): start the copies of a chunk's rows < n_c into the raw
    rows (_raw_row), 16 bytes a cp.async: none waits for another, and they land while the block
    works on the chunk before."""
    raw, rs = _recur_layout(dk, dvp, C)["raw"], _raw_row(dk, dvp, C)
    pieces, w4, p4, u4 = rs // 4, dk // 4, C // 4, dvp // 4
    p_col = dk + dv  # the scratch's columns: W, U, P, G

    @device_function
    def scratch_col(p, u_col):
        """The scratch column of piece p of a raw row (W, P, U or G)."""
        if p < w4:
            return 4 * p
        if p < 3 * w4 + p4:
            return p_col + 4 * (p - 3 * w4)
        return u_col + 4 * (p - 3 * w4 - p4) if p < 3 * w4 + p4 + u4 else p_col + C

    @device_function
    def copy(u, scratch, smf, offs, dest):
        u_stride, q_off, k_off, u_col = offs
        for e in range(cuda.threadIdx.x, C * pieces, THREADS):
            c, p = uint32(e) // pieces, uint32(e) % pieces
            if c < dest[1]:
                to = 4 * (raw + c * rs + 4 * p)
                if w4 <= p < 3 * w4:
                    col = q_off + 4 * (p - w4) if p < 2 * w4 else k_off + 4 * (p - 2 * w4)
                    cp_async_16(smf, to, u, 4 * ((dest[0] + c) * u_stride + col))
                else:
                    at = _scratch_at(dest, c) + scratch_col(p, u_col)
                    cp_async_16(smf, to, scratch, 4 * at)
    return copy


@functools.cache
def _recur_stage_fn(dk: int, dvp: int, C: int):
    """stage(smw, smf, n_c): the planes, U and G of a chunk from its raw rows (rows past n_c
    zero; G past them G_last): W | Q rows, P, K̃ᵀ = (k_c e^(G_last − G_c))ᵀ."""
    L = _recur_layout(dk, dvp, C)
    kq, kt, pp = _plane(L, "kq"), _plane(L, "kt"), _plane(L, "pp")
    g_at, uu, raw, rs = L["g"], L["uu"], L["raw"], _raw_row(dk, dvp, C)
    p_at, u_at, g_col = 3 * dk, 3 * dk + C, 3 * dk + C + dvp  # in a raw row

    @device_function
    def wq_pair(smf, row, c, col):
        """W[c] (rows < C) or q_c (the next C) at columns col, col + 1."""
        at = uint32(raw + c * rs + (dk if row >= C else 0) + col)
        return smf[at], smf[at + 1]

    @device_function
    def p_pair(smf, row, c, col):
        at = uint32(raw + c * rs + p_at + col)
        return smf[at], smf[at + 1]

    stage_wq, stage_p = _row_stager(2 * C, dk, C, wq_pair), _row_stager(C, C, C, p_pair)

    @device_function
    def kt_value(args, c, i):
        """K̃[c][i] = k_c[i] e^(G_last − G_c)."""
        smf, g_last = args
        at = uint32(raw + c * rs)
        return smf[at + uint32(2 * dk + i)] * math.exp(g_last - smf[at + uint32(g_col)])

    stage_kt = _transposed_stager(dk, C, kt_value)

    @device_function
    def stage(smw, smf, n_c):
        tid = cuda.threadIdx.x
        stage_wq(smw, kq, n_c, smf)
        stage_p(smw, pp, n_c, smf)
        for q in range(-(-C * dvp // THREADS)):
            e = uint32(tid + q * THREADS)
            c, j = e // dvp, e % dvp
            if c < C:
                smf[uint32(uu + e)] = smf[uint32(raw + c * rs + u_at + j)] if c < n_c else \
                    float32(0.0)
        for c in range(tid, C, THREADS):
            smf[uint32(g_at + c)] = smf[uint32(raw + min(c, n_c - 1) * rs + g_col)]
        stage_kt(smw, kt, n_c, (smf, smf[uint32(raw + (n_c - 1) * rs + g_col)]))
    return stage


@functools.cache
def _new_values_fn(dk: int, dvp: int, C: int):
    L = _recur_layout(dk, dvp, C)
    dt, dt_w = _plane(L, "dt")
    x_at, uu, half_c = L["x"], L["uu"], C // 2

    @device_function
    def new_values(smw, smf):
        """V'ᵀ's planes: V'[c][j] = U[c][j] − (W·S₀)[c][j] (rows past n_c: U and W zero)."""
        for q in range(-(-dvp * half_c // THREADS)):
            e = uint32(cuda.threadIdx.x + q * THREADS)
            cw, j = e // dvp, e % dvp
            if cw < half_c:
                c = 2 * cw
                _put_pair(smw, dt + j * dt_w + cw,
                          smf[uint32(uu + c * dvp + j)] - smf[uint32(x_at + c * dvp + j)],
                          smf[uint32(uu + (c + 1) * dvp + j)] -
                          smf[uint32(x_at + (c + 1) * dvp + j)])
    return new_values


@functools.cache
def _recur_kernel(dk: int, dv: int, dvp: int, C: int):
    """chunk_recur: a block per (value head, dvp of its columns) and sequence entry y, y + grid
    rows, …"""
    copy, stage = _recur_copy_fn(dk, dv, dvp, C), _recur_stage_fn(dk, dvp, C)
    state_products = _state_products_fn(dk, dvp, C)
    new_values = _new_values_fn(dk, dvp, C)
    outputs = _outputs_fn(dk, dvp, C)
    n_state, load_state, update_state, store_state = _state_fns(dk, dvp, C)
    parts, n_scratch = dv // dvp, scratch_cols(dk, dv, C)

    @kernel(fastmath=True)
    def chunk_recur(u, scratch, state, state_slots, seq_lo, seq_n, n_k_heads, head_map_mod,
                    out):
        chain_start()
        n_v_heads = cuda.gridDim.x // parts
        h, part = cuda.blockIdx.x // parts, cuda.blockIdx.x % parts
        smw = cuda.shared.array(0, uint32)  # f16 planes (_recur_layout)
        smf = cuda.shared.array(0, float32)  # the same memory: the float32 part
        s = cuda.local.array(n_state, float32)  # this lane's part of its warp's tiles of Sᵀ
        kh = h % n_k_heads if head_map_mod else h // (n_v_heads // n_k_heads)
        key_dim = n_k_heads * dk
        offs = (2 * key_dim + n_v_heads * dv, kh * dk, key_dim + kh * dk, dk + part * dvp)
        for seq in range(cuda.blockIdx.y, seq_n.size, cuda.gridDim.y):
            n = seq_n[seq]
            if n == 0:
                return  # the entries with rows come first
            lo = seq_lo[seq]
            base = ((state_slots[seq] * n_v_heads + h) * dv + part * dvp) * dk
            copy(u, scratch, smf, offs, (lo, min(C, n), h, n_v_heads, n_scratch))
            cp_async_commit()
            load_state(state, base, smw, s)
            for r in range(lo, lo + n, C):
                dest = (r, min(C, lo + n - r), h, n_v_heads, n_scratch)
                cp_async_wait(0)
                cuda.syncthreads()
                stage(smw, smf, dest[1])
                cuda.syncthreads()  # the raw rows are free: the next chunk's copies go out
                if r + C < lo + n:
                    copy(u, scratch, smf, offs, (r + C, min(C, lo + n - r - C), h, n_v_heads,
                                                 n_scratch))
                    cp_async_commit()
                state_products(smw, smf)
                cuda.syncthreads()
                new_values(smw, smf)
                cuda.syncthreads()
                outputs(smw, smf, out, r, dest[1], n_v_heads * dv, h * dv + part * dvp)
                update_state(smw, smf, s)
                cuda.syncthreads()
            store_state(state, base, s)
    return chunk_recur


def delta_rule_chunked(u, a, b, state, state_slots, seq_lo, seq_n, out, chunks: ChunkedPass, *,
                       n_k_heads: int, head_map_mod: bool, chunk: int = CHUNK,
                       cols: int | None = None, stream=0) -> None:
    """The gated delta rule over each sequence's rows, a chunk of tokens at a time, on prepared
    inputs: u's q, k L2-normalised (q also / sqrt(dk)), a the log-decay and b the β of each row
    and value head. Shapes and state as gated_delta.delta_rule_seq, with the sequence entries
    that have rows first; chunks: the scratch and chunk_list's list for this chunk size. cols:
    the value columns a recurrence block takes (default: _cols)."""
    n_rows, n_v_heads, dv = out.shape
    dk = state.shape[3]
    dvp = cols or _cols(dv)
    if not supports(dk, dv) or state.shape[1:3] != (n_v_heads, dv) or chunk % 16 or dv % dvp \
            or dvp % 16:
        raise ValueError(f"state {state.shape}, chunk {chunk}, cols {dvp}: the chunked kernels "
                         f"take dk ≤ {MAX_DK}, dk, dv and cols multiples of 16, dv ≤ 128, "
                         f"chunks of 16·m")
    if u.shape != (n_rows, 2 * n_k_heads * dk + n_v_heads * dv):
        raise ValueError(f"u {u.shape} is not (n_rows, 2·H_k·dk + H_v·dv)")
    shared = 4 * max(_prep_layout(dk, dv, chunk)["words"], _recur_layout(dk, dvp, chunk)["words"])
    if shared > MAX_SHARED_BYTES:
        raise ValueError(f"chunks of {chunk} rows of heads dk {dk}, {dvp} value columns a block "
                         f"need {shared} bytes of shared memory (at most {MAX_SHARED_BYTES})")
    check_array("a", a, np.float32, (n_rows, n_v_heads))
    check_array("b", b, np.float32, (n_rows, n_v_heads))
    check_array("scratch", chunks.scratch, np.float32,
                (n_rows, n_v_heads, scratch_cols(dk, dv, chunk)))
    check_array("chunk_lo", chunks.chunk_lo, np.int32)
    check_array("chunk_n", chunks.chunk_n, np.int32, chunks.chunk_lo.shape)
    launch_prep(u, a, b, chunks, n_k_heads=n_k_heads, head_map_mod=head_map_mod, dk=dk,
                chunk=chunk, stream=stream)
    launch_recur(u, chunks, state, state_slots, seq_lo, seq_n, out, n_k_heads=n_k_heads,
                 head_map_mod=head_map_mod, chunk=chunk, cols=dvp, stream=stream)


def launch_prep(u, a, b, chunks: ChunkedPass, *, n_k_heads: int, head_map_mod: bool, dk: int,
                chunk: int, stream=0) -> None:
    """chunk_prep over the pass's chunk list (delta_rule_chunked's first half, its arguments
    checked there)."""
    n_rows, n_v_heads = a.shape
    dv = (u.shape[1] - 2 * n_k_heads * dk) // n_v_heads
    # one wave of blocks, each walking its chunks y, y + grid rows, … with the next one's copies
    # in flight while it works on one
    prep_rows = min(chunks.chunk_lo.size, cdiv(n_rows, chunk) + SEQ_BLOCKS,
                    max(1, PREP_BLOCKS_PER_SM * multiprocessors() // n_v_heads))
    _prep_kernel(dk, dv, chunk)[(n_v_heads, prep_rows), THREADS, stream,
                                4 * _prep_layout(dk, dv, chunk)["words"]](
        u.reshape(u.size), a.reshape(a.size), b.reshape(b.size), chunks.chunk_lo, chunks.chunk_n,
        n_k_heads, head_map_mod, chunks.scratch.reshape(chunks.scratch.size))


def launch_recur(u, chunks: ChunkedPass, state, state_slots, seq_lo, seq_n, out, *,
                 n_k_heads: int, head_map_mod: bool, chunk: int, cols: int, stream=0) -> None:
    """chunk_recur over the sequence entries (delta_rule_chunked's second half)."""
    _, n_v_heads, dv = out.shape
    dk = state.shape[3]
    grid = (n_v_heads * (dv // cols), min(seq_n.size, SEQ_BLOCKS))
    _recur_kernel(dk, dv, cols, chunk)[grid, THREADS, stream,
                                       4 * _recur_layout(dk, cols, chunk)["words"]](
        u.reshape(u.size), chunks.scratch.reshape(chunks.scratch.size), state.reshape(state.size),
        state_slots, seq_lo, seq_n, n_k_heads, head_map_mod, out.reshape(out.size))
