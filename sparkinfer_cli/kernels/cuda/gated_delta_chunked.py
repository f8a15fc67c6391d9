"""The gated delta rule over whole chunks of a sequence's tokens (the WY form) on tensor cores.

The token-by-token kernel (gated_delta.delta_seq) advances the state one token at a time: every
token is a chain of dependent dot products and shuffles. Here a block takes C tokens at once (the
math of the CPU reference `kernels/cpu/gated_delta.gated_delta_chunked`, with Sᵀ[j][i] the state
of value column j): with G_c the chunk's cumulative log-decay up to token c and S₀ the state
before it,

    A[c][c'] = β_c e^(G_c − G_c') k_c·k_c'  (c' < c)    P[c][c'] = e^(G_c − G_c') q_c·k_c' (c' ≤ c)
    R[c] = β_c (v_c − e^(G_c) S₀ k_c)           D = (I + A)⁻¹ R
    o_c = e^(G_c) S₀ q_c + Σ_c' P[c][c'] D[c']
    Sᵀ  = e^(G_last) S₀ᵀ + Dᵀ K̃,  k̃_c = e^(G_last − G_c) k_c

Five of these are matrix products (mma.sync m16n8k16): [K; Q]·Kᵀ (A and P), [K; Q]·S₀ (the
state's products), Dᵀ = Rᵀ·(I + A)⁻ᵀ, P·D (outputs) and Dᵀ·K̃ (the update); only the inverse
runs row by row, in one warp's registers. Each operand is staged in shared memory as two f16
planes, x ≈ hi + lo with hi = f16(x), lo = f16(x − hi), and a product takes three mma (hi·hi +
hi·lo + lo·hi, f32 sums): about float32's precision, at a third of the tensor cores' rate, which
these small products leave idle anyway. A block keeps its part of Sᵀ in its warps' accumulator
registers over the whole sequence.

A launch runs two grids, one of blocks per (sequence, value head) and one per (sequence, value
head, NARROW_COLS columns) (a captured pass cannot know its sequence count on the host); a block
with a sequence of its own counts the pass's sequences, and the grid that does not suit them
exits: with enough (sequence, head) pairs to fill the GPU a block takes all of a
head's columns, otherwise (a few long prompts) a head's columns split over several blocks, each
of which computes the chunk's A and P again. Inputs are prepared (gated_delta's prepare step with
log_decay): q, k L2-normalised (q also / sqrt(dk)), a the log-decay, b the β.

Opt-in (SPARKINFER_GDN_CHUNKED): on an H100 it has not yet beaten the token kernel
(bench/results/2026-12-06-gdn-chunked-prefill.md says by how much and what the profile should
look at next).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from sparkinfer_cli.kernels.cuda.mma_fragments import mma_into
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import chain_start, f16_bits_to_f32, pack_f16x2
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import check_array
from sparkinfer_cli.kernels.cuda.runtime.warp import shfl_xor

CHUNK = 32  # tokens a chunk (two k16 steps of the P·D and update products)
WARPS = 8
THREADS = 32 * WARPS
NARROW_COLS = 32  # value columns a block takes when the pass has few sequences
WIDE_PASS = 256  # (sequence, head) pairs from which a block takes all of a head's columns
SEQ_BLOCKS = 64  # grid rows; block row y runs sequence entries y, y + 64, …
MAX_DK = 128  # shared memory: the chunk's rows and the state as f16 planes, under 227 KiB
ROW_PAD = 8  # halves padding a staged row: a fragment load's 8 rows × 4 words hit 32 banks


def supports(dk: int, dv: int) -> bool:
    """Whether the chunked kernel takes heads of this size."""
    return dk % 16 == 0 and dk <= MAX_DK and dv % 16 == 0 and dv <= 128


@functools.cache
def _layout(dk: int, dvp: int, C: int) -> dict[str, int]:
    """Word offsets of a block's shared memory: f16 planes (hi at `name`, lo at `name_lo`, rows of
    `name_w` words) of the chunk's k | q rows, k̃ᵀ, Sᵀ, Rᵀ then Dᵀ, P and T = (I + A)⁻¹, then
    float32 X = [S₀k; S₀q], A, G and β; `words` in all."""
    planes = {"kq": (2 * C, dk), "kt": (dk, C), "st": (dvp, dk), "dt": (dvp, C), "pp": (C, C),
              "tt": (C, C)}
    at, out = 0, {}
    for name, (rows, cols) in planes.items():
        w = (cols + ROW_PAD) // 2
        out[name], out[name + "_lo"], out[name + "_w"] = at, at + rows * w, w
        at += 2 * rows * w
    for name, size in (("x", 2 * C * dvp), ("am", C * C), ("g", C), ("beta", C)):
        out[name] = at
        at += size
    out["words"] = at
    return out


def _plane(layout: dict[str, int], name: str) -> tuple[int, int, int]:
    """(hi word, lo word, words a row) of one of _layout's f16 planes."""
    return layout[name], layout[name + "_lo"], layout[name + "_w"]


def _warp_share(row_tiles: int, col_tiles: int) -> tuple[int, int]:
    """(tiles a warp, accumulators a lane) of a product of row_tiles × col_tiles mma tiles."""
    per_warp = -(-row_tiles * col_tiles // WARPS)
    return per_warp, 4 * per_warp


def shared_bytes(dk: int, dvp: int, chunk: int = CHUNK) -> int:
    return 4 * _layout(dk, dvp, chunk)["words"]


@device_function
def _put_pair(smw, hi_at, lo_at, x, y):
    """f16 planes ← floats x, y (adjacent halves of one word): hi = f16, lo = f16(rest)."""
    h = pack_f16x2(x, y)
    smw[uint32(hi_at)] = h
    smw[uint32(lo_at)] = pack_f16x2(x - f16_bits_to_f32(h & 0xFFFF), y - f16_bits_to_f32(h >> 16))


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


@device_function
def _frags_a(smw, a_hi, a_lo, aw, row0, kw):
    """The A fragments of both planes."""
    return _frag_a(smw, a_hi, aw, row0, kw), _frag_a(smw, a_lo, aw, row0, kw)


@device_function(numba_inline=True)
def _mma3(acc, i, a, smw, b_hi, b_lo, bw, n0, kw):
    """acc[i..i+3] += A·B for one m16n8k16 tile, A (its fragments of both planes: _frags_a) and
    B as f16 planes hi + lo."""
    ah, al = a
    bh0, bh1 = _frag_b(smw, b_hi, bw, n0, kw)
    bl0, bl1 = _frag_b(smw, b_lo, bw, n0, kw)
    mma_into(acc, i, al, bh0, bh1)
    mma_into(acc, i, ah, bl0, bl1)
    mma_into(acc, i, ah, bh0, bh1)


@device_function
def _tile_element(row0, n0, e):
    """(row, column) of accumulator element e (0..3) of this lane in the tile at (row0, n0)."""
    lane = cuda.threadIdx.x & 31
    return row0 + (lane >> 2) + 8 * (e >> 1), n0 + 2 * (lane & 3) + (e & 1)


@device_function
def _owns_sequences(seq_n):
    """Whether any of this block's sequence entries (y, y + grid rows, …) has rows: a block
    without work leaves before it counts the pass's sequences."""
    y, rows = cuda.blockIdx.y, cuda.gridDim.y
    n_mine = (seq_n.size - y + rows - 1) // rows
    mine = int32(0)
    for k in range(cuda.threadIdx.x, n_mine, cuda.blockDim.x):
        if seq_n[y + k * rows] > 0:
            mine = int32(1)
    return cuda.syncthreads_or(mine) != 0


@device_function
def _active_sequences(seq_n):
    """Sequence entries with rows, counted by the whole block."""
    count = 0
    for base in range(0, seq_n.size, cuda.blockDim.x):
        e = base + cuda.threadIdx.x
        has_rows = int32(0)
        if e < seq_n.size and seq_n[e] > 0:
            has_rows = int32(1)
        count += cuda.syncthreads_count(has_rows)
    return count


@functools.cache
def _load_fn(dk: int, dvp: int, C: int):
    L = _layout(dk, dvp, C)
    kq, kq_lo, kq_w = _plane(L, "kq")
    kt, kt_lo, kt_w = _plane(L, "kt")
    g_at, b_at = L["g"], L["beta"]
    half_dk, half_c = dk // 2, C // 2

    @device_function
    def load_chunk(u, a, b, smw, smf, r, n_c, u_stride, q_off, k_off, h, n_v_heads):
        """Stage tokens r .. r + n_c − 1 (rows past n_c zero: they neither decay nor write): k | q
        rows, G (the log-decays summed over the chunk), β, and k̃ᵀ = (k_c e^(G_last − G_c))ᵀ."""
        tid = cuda.threadIdx.x
        for q in range(-(-2 * C * half_dk // THREADS)):  # a fixed count: its loads go out at once
            e = tid + q * THREADS
            row, wd = e // half_dk, e % half_dk
            c = row % C
            x, y = float32(0.0), float32(0.0)
            if c < n_c and row < 2 * C:
                src = (r + c) * u_stride + (q_off if row >= C else k_off) + 2 * wd
                x, y = u[src], u[src + 1]
            if row < 2 * C:
                _put_pair(smw, kq + row * kq_w + wd, kq_lo + row * kq_w + wd, x, y)
        for c in range(tid, C, THREADS):
            smf[g_at + c] = a[(r + c) * n_v_heads + h] if c < n_c else float32(0.0)
            smf[b_at + c] = b[(r + c) * n_v_heads + h] if c < n_c else float32(0.0)
        cuda.syncthreads()
        if tid == 0:
            for c in range(1, C):
                smf[g_at + c] += smf[g_at + c - 1]
        cuda.syncthreads()
        g_last = smf[g_at + C - 1]
        for q in range(-(-dk * half_c // THREADS)):
            e = tid + q * THREADS
            if e >= dk * half_c:
                break
            i, cw = e // half_c, e % half_c
            c = 2 * cw
            x, y = float32(0.0), float32(0.0)
            if c < n_c:
                x = u[(r + c) * u_stride + k_off + i] * math.exp(g_last - smf[g_at + c])
            if c + 1 < n_c:
                y = u[(r + c + 1) * u_stride + k_off + i] * math.exp(g_last - smf[g_at + c + 1])
            _put_pair(smw, kt + i * kt_w + cw, kt_lo + i * kt_w + cw, x, y)
    return load_chunk


@functools.cache
def _token_products_fn(dk: int, dvp: int, C: int):
    """token_products: A (float32, strictly lower) and P (f16 planes, lower with the diagonal)
    from [K; Q]·Kᵀ: a warp per 16 rows × 16 columns of the 2C × C product."""
    L = _layout(dk, dvp, C)
    kq, kq_lo, kq_w = _plane(L, "kq")
    pp, pp_lo, pp_w = _plane(L, "pp")
    am, g_at, b_at = L["am"], L["g"], L["beta"]
    tiles = (2 * C // 16) * (C // 16)  # warp tiles of 16 × 16

    @device_function
    def masked(smf, row, c2, v):
        """A[row][c2] (row < C) or P[row − C][c2] from its dot product v."""
        c = row if row < C else row - C
        if c2 > c or (row < C and c2 == c):
            return float32(0.0)
        v *= math.exp(smf[g_at + c] - smf[g_at + c2])
        return v * smf[b_at + c] if row < C else v

    @device_function
    def token_products(smw, smf):
        warp = cuda.threadIdx.x >> 5
        for t in range(warp, tiles, WARPS):
            row0, n0 = 16 * (t // (C // 16)), 16 * (t % (C // 16))
            acc = cuda.local.array(8, float32)
            for i in range(8):
                acc[i] = 0.0
            for kw in range(0, dk // 2, 8):
                a = _frags_a(smw, kq, kq_lo, kq_w, row0, kw)
                for nt in range(2):
                    _mma3(acc, 4 * nt, a, smw, kq, kq_lo, kq_w, n0 + 8 * nt, kw)
            for nt in range(2):
                for e in range(0, 4, 2):
                    row, c2 = _tile_element(row0, n0 + 8 * nt, e)
                    v0 = masked(smf, row, c2, acc[4 * nt + e])
                    v1 = masked(smf, row, c2 + 1, acc[4 * nt + e + 1])
                    if row < C:
                        smf[uint32(am + row * C + c2)] = v0
                        smf[uint32(am + row * C + c2 + 1)] = v1
                    else:
                        wd = (row - C) * pp_w + c2 // 2
                        _put_pair(smw, pp + wd, pp_lo + wd, v0, v1)
    return token_products


@functools.cache
def _state_products_fn(dk: int, dvp: int, C: int):
    """state_products: X = [K; Q]·S₀ (2C × dvp, float32), 16 × 8 tiles spread over the warps
    (a warp keeps one row tile: its A fragments serve all its column tiles)."""
    L = _layout(dk, dvp, C)
    kq, kq_lo, kq_w = _plane(L, "kq")
    st, st_lo, st_w = _plane(L, "st")
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
                a = _frags_a(smw, kq, kq_lo, kq_w, row0, kw)
                for q in range(group):
                    t = warp + WARPS * (q0 + q)
                    if t < row_tiles * col_tiles:
                        _mma3(acc, 4 * q, a, smw, st, st_lo, st_w, 8 * (t // row_tiles), kw)
            for q in range(group):
                t = warp + WARPS * (q0 + q)
                if t < row_tiles * col_tiles:
                    for e in range(4):
                        row, j = _tile_element(row0, 8 * (t // row_tiles), e)
                        smf[uint32(x_at + row * dvp + j)] = acc[4 * q + e]
    return state_products


@functools.cache
def _inverse_fn(C: int, am: int, tt: int, tt_lo: int, tt_w: int):
    """invert(smw, smf): T = (I + A)⁻¹ (A strictly lower, float32 at word am) into T's f16 planes
    (rows c, k = c' contiguous), by warp 0, lane c' computing column c' in registers: once T[c2]
    is final, A[c][c2]·T[c2] leaves every row c below it, so the critical path is C dependent
    multiply-adds. The C(C − 1)/2 of them are written out here (generated source): a loop nest
    that size is left rolled by LLVM, which would put the column in local memory."""
    body = [f"    t{c} = float32(1.0) if lane == {c} else float32(0.0)" for c in range(C)]
    for c2 in range(C - 1):
        body += [f"    t{c} -= smf[{am + c * C + c2}] * t{c2}" for c in range(c2 + 1, C)]
    body += [f"    pair(smw, {c}, lane, t{c})" for c in range(C)]
    source = "def column(smw, smf, lane):\n" + "\n".join(body) + "\n"
    namespace = {"__name__": __name__, "float32": float32, "pair": _pair_fn(C, tt, tt_lo, tt_w)}
    exec(compile(source, f"<gated_delta_chunked inverse C={C}>", "exec"), namespace)
    column = device_function(namespace["column"])

    @device_function
    def invert(smw, smf):
        if cuda.threadIdx.x < 32:
            column(smw, smf, cuda.threadIdx.x)
    return invert


@functools.cache
def _pair_fn(C: int, tt: int, tt_lo: int, tt_w: int):
    @device_function
    def pair(smw, c, lane, v):
        """T[c][lane] and T[c][lane + 1] (from the next lane) into a word of T's planes."""
        right = shfl_xor(v, 1)
        if lane < C and lane % 2 == 0:
            _put_pair(smw, tt + c * tt_w + lane // 2, tt_lo + c * tt_w + lane // 2, v, right)
    return pair


@functools.cache
def _deltas_fn(dk: int, dvp: int, C: int):
    """D = (I + A)⁻¹ R in three steps: R's f16 planes (every thread), the inverse T = (I + A)⁻¹
    (warp 0, _inverse_fn), then Dᵀ = Rᵀ·Tᵀ on the tensor cores, 16 × 8 tiles, a warp one row
    tile of value columns (as the update)."""
    L = _layout(dk, dvp, C)
    x_at, am, g_at, b_at = L["x"], L["am"], L["g"], L["beta"]
    dt, dt_lo, dt_w = _plane(L, "dt")
    tt, tt_lo, tt_w = _plane(L, "tt")
    row_tiles, col_tiles = dvp // 16, C // 8
    per_warp, n_acc = _warp_share(row_tiles, col_tiles)
    half_c = C // 2

    @device_function
    def residuals(u, smw, smf, r, n_c, u_stride, v_off):
        """Rᵀ's planes (in Dᵀ's place): R[c][j] = β_c (v − e^(G_c) S₀k_c)[j]."""
        for q in range(-(-dvp * half_c // THREADS)):
            e = cuda.threadIdx.x + q * THREADS
            if e < dvp * half_c:
                cw, j = e // dvp, e % dvp
                rv = cuda.local.array(2, float32)
                for h in range(2):
                    c = 2 * cw + h
                    v = u[(r + c) * u_stride + v_off + j] if c < n_c else float32(0.0)
                    rv[h] = smf[b_at + c] * (v - math.exp(smf[g_at + c]) *
                                             smf[uint32(x_at + c * dvp + j)])
                _put_pair(smw, dt + j * dt_w + cw, dt_lo + j * dt_w + cw, rv[0], rv[1])

    invert = _inverse_fn(C, am, tt, tt_lo, tt_w)

    @device_function
    def deltas(smw):
        """Dᵀ's planes ← Rᵀ·Tᵀ (all warps read Rᵀ's planes before any writes Dᵀ there)."""
        warp = cuda.threadIdx.x >> 5
        row0 = 16 * (warp % row_tiles)
        acc = cuda.local.array(n_acc, float32)
        for i in range(n_acc):
            acc[i] = 0.0
        for kw in range(0, half_c, 8):
            a = _frags_a(smw, dt, dt_lo, dt_w, row0, kw)
            for q in range(per_warp):
                t = warp + WARPS * q
                if t < row_tiles * col_tiles:
                    _mma3(acc, 4 * q, a, smw, tt, tt_lo, tt_w, 8 * (t // row_tiles), kw)
        cuda.syncthreads()
        for q in range(per_warp):
            t = warp + WARPS * q
            if t < row_tiles * col_tiles:
                for e in range(0, 4, 2):
                    j, c = _tile_element(row0, 8 * (t // row_tiles), e)
                    wd = j * dt_w + c // 2
                    _put_pair(smw, dt + wd, dt_lo + wd, acc[4 * q + e], acc[4 * q + e + 1])
    return residuals, invert, deltas


@functools.cache
def _outputs_fn(dk: int, dvp: int, C: int):
    """outputs: o = e^G S₀q + P·D for the chunk's rows < n_c, 16 × 8 tiles over the warps."""
    L = _layout(dk, dvp, C)
    pp, pp_lo, pp_w = _plane(L, "pp")
    dt, dt_lo, dt_w = _plane(L, "dt")
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
                    acc[4 * q + e] = math.exp(smf[g_at + c]) * smf[uint32(x_at + (C + c) * dvp + j)]
        for kw in range(0, C // 2, 8):
            a = _frags_a(smw, pp, pp_lo, pp_w, row0, kw)
            for q in range(per_warp):
                t = warp + WARPS * q
                if t < row_tiles * col_tiles:
                    _mma3(acc, 4 * q, a, smw, dt, dt_lo, dt_w, 8 * (t // row_tiles), kw)
        for q in range(per_warp):
            t = warp + WARPS * q
            for e in range(4):
                c, j = _tile_element(row0, 8 * (t // row_tiles), e)
                if t < row_tiles * col_tiles and c < n_c:
                    out[(r + c) * o_row + o_base + j] = acc[4 * q + e]
    return outputs


@functools.cache
def _state_fns(dk: int, dvp: int, C: int):
    """The block's part of Sᵀ (dvp × dk) lives in its warps' accumulators: 16 × 8 tiles, a warp
    keeping one row tile of value columns. Returns (accumulators a lane, load, update, store)."""
    L = _layout(dk, dvp, C)
    st, st_lo, st_w = _plane(L, "st")
    dt, dt_lo, dt_w = _plane(L, "dt")
    kt, kt_lo, kt_w = _plane(L, "kt")
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
                    _put_pair(smw, st + wd, st_lo + wd, s[4 * q + e], s[4 * q + e + 1])

    @device_function(numba_inline=True)  # s: the kernel's registers
    def load(state, base, smw, s):
        """s ← Sᵀ of the part from the global state (S[j][i], i contiguous), and its planes."""
        warp = cuda.threadIdx.x >> 5
        for q in range(per_warp):
            t = warp + WARPS * q
            if t < row_tiles * col_tiles:
                for e in range(4):
                    j, i = _tile_element(16 * (warp % row_tiles), 8 * (t // row_tiles), e)
                    s[4 * q + e] = state[base + j * dk + i]
        to_planes(smw, s)

    @device_function(numba_inline=True)  # s: the kernel's registers
    def update(smw, smf, s):
        """Sᵀ ← e^(G_last) Sᵀ + Dᵀ·K̃."""
        warp = cuda.threadIdx.x >> 5
        decay = math.exp(smf[g_at + C - 1])
        for i in range(n_acc):
            s[i] *= decay
        for kw in range(0, C // 2, 8):
            a = _frags_a(smw, dt, dt_lo, dt_w, 16 * (warp % row_tiles), kw)
            for q in range(per_warp):
                t = warp + WARPS * q
                if t < row_tiles * col_tiles:
                    _mma3(s, 4 * q, a, smw, kt, kt_lo, kt_w, 8 * (t // row_tiles), kw)
        to_planes(smw, s)

    @device_function(numba_inline=True)  # s: the kernel's registers
    def store(state, base, s):
        warp = cuda.threadIdx.x >> 5
        for q in range(per_warp):
            t = warp + WARPS * q
            if t < row_tiles * col_tiles:
                for e in range(4):
                    j, i = _tile_element(16 * (warp % row_tiles), 8 * (t // row_tiles), e)
                    state[base + j * dk + i] = s[4 * q + e]
    return n_acc, load, update, store


def _narrow_cols(dv: int) -> int:
    """Value columns a block takes when a pass has few sequences (dv: no narrow grid)."""
    return NARROW_COLS if dv > NARROW_COLS and dv % NARROW_COLS == 0 else dv


@functools.cache
def _chunk_kernel(dk: int, dv: int, dvp: int, C: int):
    """The kernel of blocks taking dvp of a head's dv value columns (dvp = dv: the wide grid)."""
    load_chunk = _load_fn(dk, dvp, C)
    token_products = _token_products_fn(dk, dvp, C)
    state_products = _state_products_fn(dk, dvp, C)
    residuals, invert, deltas = _deltas_fn(dk, dvp, C)
    outputs = _outputs_fn(dk, dvp, C)
    n_state, load_state, update_state, store_state = _state_fns(dk, dvp, C)
    parts = dv // dvp
    two_grids = _narrow_cols(dv) < dv  # a launch also runs the other grid

    @kernel(fastmath=True)
    def delta_chunked(u, a, b, state, state_slots, seq_lo, seq_n, n_k_heads, head_map_mod,
                      wide_pass, out):
        chain_start()
        n_v_heads = cuda.gridDim.x // parts
        h, part = cuda.blockIdx.x // parts, cuda.blockIdx.x % parts
        if not _owns_sequences(seq_n):
            return
        if two_grids and (_active_sequences(seq_n) * n_v_heads >= wide_pass) != (parts == 1):
            return  # the other grid of the launch suits this pass
        smw = cuda.shared.array(0, uint32)  # f16 planes (_layout)
        smf = cuda.shared.array(0, float32)  # the same memory: the float32 part
        s = cuda.local.array(n_state, float32)  # this lane's part of its warp's tiles of Sᵀ
        kh = h % n_k_heads if head_map_mod else h // (n_v_heads // n_k_heads)
        key_dim = n_k_heads * dk
        u_stride = 2 * key_dim + n_v_heads * dv
        q_off, k_off = kh * dk, key_dim + kh * dk
        v_off = 2 * key_dim + h * dv + part * dvp
        for seq in range(cuda.blockIdx.y, seq_n.size, cuda.gridDim.y):
            n = seq_n[seq]
            if n == 0:
                continue
            lo = seq_lo[seq]
            base = ((state_slots[seq] * n_v_heads + h) * dv + part * dvp) * dk
            load_state(state, base, smw, s)
            for r in range(lo, lo + n, C):
                n_c = min(C, lo + n - r)
                load_chunk(u, a, b, smw, smf, r, n_c, u_stride, q_off, k_off, h, n_v_heads)
                token_products(smw, smf)
                state_products(smw, smf)
                cuda.syncthreads()
                residuals(u, smw, smf, r, n_c, u_stride, v_off)
                invert(smw, smf)
                cuda.syncthreads()
                deltas(smw)
                cuda.syncthreads()
                outputs(smw, smf, out, r, n_c, n_v_heads * dv, h * dv + part * dvp)
                update_state(smw, smf, s)
                cuda.syncthreads()
            store_state(state, base, s)
    return delta_chunked


def delta_rule_chunked(u, a, b, state, state_slots, seq_lo, seq_n, out, *, n_k_heads: int,
                       head_map_mod: bool, chunk: int = CHUNK, wide_pass: int = WIDE_PASS,
                       stream=0) -> None:
    """The gated delta rule over each sequence's rows, a chunk of tokens at a time, on prepared
    inputs: u's q, k L2-normalised (q also / sqrt(dk)), a the log-decay and b the β of each row
    and value head. Shapes and state as gated_delta.delta_rule_seq. wide_pass: the (sequence,
    head) pairs from which a block takes all of a head's value columns."""
    n_rows, n_v_heads, dv = out.shape
    dk = state.shape[3]
    if not supports(dk, dv) or state.shape[1:3] != (n_v_heads, dv) or chunk % 16:
        raise ValueError(f"state {state.shape}, chunk {chunk}: the chunked kernel takes dk ≤ "
                         f"{MAX_DK}, dk and dv multiples of 16, dv ≤ 128, chunks of 16·m")
    if u.shape != (n_rows, 2 * n_k_heads * dk + n_v_heads * dv):
        raise ValueError(f"u {u.shape} is not (n_rows, 2·H_k·dk + H_v·dv)")
    check_array("a", a, np.float32, (n_rows, n_v_heads))
    check_array("b", b, np.float32, (n_rows, n_v_heads))
    args = (u.reshape(u.size), a.reshape(a.size), b.reshape(b.size), state.reshape(state.size),
            state_slots, seq_lo, seq_n, n_k_heads, head_map_mod, wide_pass, out.reshape(out.size))
    for dvp in sorted({dv, _narrow_cols(dv)}):
        parts = dv // dvp
        # the narrow grid runs passes of fewer than wide_pass / H_v sequences: as many rows
        rows = min(seq_n.size, SEQ_BLOCKS if parts == 1 else -(-wide_pass // n_v_heads))
        _chunk_kernel(dk, dv, dvp, chunk)[(n_v_heads * parts, rows), THREADS, stream,
                                          shared_bytes(dk, dvp, chunk)](*args)
