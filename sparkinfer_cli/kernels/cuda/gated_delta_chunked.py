"""The gated delta rule over whole chunks of a sequence's tokens (the WY form), for prefill.

The token-by-token kernel (gated_delta.delta_seq) advances the state one token at a time: every
token is a chain of dependent dot products and shuffles, and its q / k rows are read again by
every column of the state. Here a block takes C tokens at once (the math of the CPU reference
`kernels/cpu/gated_delta.gated_delta_chunked`, with S[j][i] the state of value column j): with
G_c the chunk's cumulative log-decay up to token c and S₀ the state before it,

    A[c][c'] = β_c e^(G_c − G_c') k_c·k_c'  (c' < c)    P[c][c'] = e^(G_c − G_c') q_c·k_c' (c' ≤ c)
    R[c] = β_c (v_c − e^(G_c) S₀ k_c)           D = (I + A)⁻¹ R   (forward substitution)
    o_c = e^(G_c) S₀ q_c + Σ_c' P[c][c'] D[c']
    S   = e^(G_last) S₀ + Σ_c e^(G_last − G_c) D[c] ⊗ k_c

so the state enters only through products of whole matrices held in shared memory, which each
thread computes in register tiles of 4 × 4 outputs. Inputs are prepared (gated_delta's prepare
step with log_decay): q, k L2-normalised (q also / sqrt(dk)), a the log-decay, b the β.

A block runs one (sequence, value head, part of the value columns). Blocks count the sequences
of the pass first: with enough (sequence, head) pairs to fill the GPU a block takes all dv
columns; otherwise (a few long prompts) the columns are split over PARTS blocks, each of which
computes the chunk's A and P again, so that the GPU still has blocks to run.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from sparkinfer_cli.kernels.cuda.runtime.intrinsics import IS_SIMULATOR, bits_to_f32, chain_start
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import check_array

CHUNK = 32  # tokens a chunk
THREADS = 32 if IS_SIMULATOR else 256
PARTS = 4  # value-column parts a head splits into when sequences are few
WIDE_PASS = 256  # (sequence, head) pairs from which a block takes all of a head's columns
SEQ_BLOCKS = 64  # grid rows; block row y runs sequence entries y, y + 64, …
MAX_DK = 128  # shared memory holds 2·CHUNK rows of dk plus the dk × dv state

if IS_SIMULATOR:

    def lds4(arr, i):
        """Floats i..i + 3 of a shared float32 array."""
        return arr[i], arr[i + 1], arr[i + 2], arr[i + 3]

else:
    from sparkinfer_cli.kernels.cuda.runtime.intrinsics import lds_v4_u32

    @device_function
    def lds4(arr, i):
        """Floats i..i + 3 of a shared float32 array in one load (i a multiple of 4)."""
        w = lds_v4_u32(arr, i)
        return bits_to_f32(w[0]), bits_to_f32(w[1]), bits_to_f32(w[2]), bits_to_f32(w[3])


def supports(dk: int, dv: int) -> bool:
    """Whether the chunked kernel takes heads of this size."""
    return dk % 4 == 0 and dk <= MAX_DK and dv % (4 * PARTS) == 0


def shared_floats(dk: int, dv: int, chunk: int = CHUNK) -> int:
    """Floats of shared memory a block uses: the chunk's k | q rows (stride dk + 1: a warp's
    column reads fall in distinct banks; up to 3 floats to align what follows), the state, the
    products [K; Q]·S, A, P, G and β."""
    return 2 * chunk * (dk + 1) + 3 + dk * dv + 2 * chunk * dv + 2 * chunk * chunk + 2 * chunk


@functools.cache
def _phases(dk: int, dv: int, C: int):
    """The device functions of one chunk, over shared memory laid out as shared_floats says."""
    kq_stride = dk + 1
    s_at = 2 * C * kq_stride
    s_at += -s_at % 4  # float4 reads of the state and X rows
    x_at = s_at + dk * dv
    a_at = x_at + 2 * C * dv
    p_at = a_at + C * C
    g_at = p_at + C * C
    b_at = g_at + C

    @device_function
    def load_chunk(u, a, b, sm, r, n_c, u_stride, q_off, k_off, h, n_v_heads):
        """k | q rows of tokens r .. r + n_c − 1 (rows past n_c zero), log-decays summed over the
        chunk into G, and β (zero past n_c: those rows neither decay nor write)."""
        tid, T = cuda.threadIdx.x, cuda.blockDim.x
        for e in range(tid, 2 * C * dk, T):
            row, i = e // dk, e % dk
            c = row % C
            off = q_off if row >= C else k_off
            sm[row * kq_stride + i] = u[(r + c) * u_stride + off + i] if c < n_c else float32(0)
        for c in range(tid, C, T):
            sm[g_at + c] = a[(r + c) * n_v_heads + h] if c < n_c else float32(0)
            sm[b_at + c] = b[(r + c) * n_v_heads + h] if c < n_c else float32(0)
        cuda.syncthreads()
        if tid == 0:
            for c in range(1, C):
                sm[g_at + c] += sm[g_at + c - 1]
        cuda.syncthreads()

    @device_function
    def token_products(sm):
        """A (strictly lower) and P (lower with the diagonal) from the chunk's rows."""
        for e in range(cuda.threadIdx.x, C * C, cuda.blockDim.x):
            c, c2 = e // C, e % C
            kk, qk = float32(0.0), float32(0.0)
            if c2 <= c:
                k2, k1 = uint32(c2 * kq_stride), uint32(c * kq_stride)
                q1 = uint32((C + c) * kq_stride)
                for i in range(dk):
                    kc2 = sm[k2 + uint32(i)]
                    kk += sm[k1 + uint32(i)] * kc2
                    qk += sm[q1 + uint32(i)] * kc2
                decay = math.exp(sm[g_at + c] - sm[g_at + c2])
                kk *= decay * sm[b_at + c]
                qk *= decay
            sm[a_at + e] = kk if c2 < c else float32(0.0)
            sm[p_at + e] = qk

    @device_function
    def state_products(sm, dvp):
        """X = [K; Q] · S: rows c < C are S₀k_c, rows C + c are S₀q_c (columns of this part)."""
        col_tiles = dvp // 4
        for t in range(cuda.threadIdx.x, 2 * C // 4 * col_tiles, cuda.blockDim.x):
            r0, j0 = 4 * (t // col_tiles), 4 * (t % col_tiles)
            acc = cuda.local.array(16, float32)
            for m in range(16):
                acc[m] = 0.0
            for i in range(dk):
                s = lds4(sm, uint32(s_at + i * dvp + j0))
                for m in range(4):
                    x = sm[uint32((r0 + m) * kq_stride + i)]
                    for n in range(4):
                        acc[4 * m + n] += x * s[n]
            for m in range(4):
                for n in range(4):
                    sm[x_at + (r0 + m) * dvp + j0 + n] = acc[4 * m + n]

    @device_function
    def solve_deltas(u, sm, r, n_c, u_stride, v_off, dvp):
        """Rows c < C of X become D: R = β(v − e^G S₀k), then (I + A) D = R row by row."""
        for j in range(cuda.threadIdx.x, dvp, cuda.blockDim.x):
            for c in range(C):
                v = u[(r + c) * u_stride + v_off + j] if c < n_c else float32(0.0)
                at = x_at + c * dvp + j
                sm[at] = sm[b_at + c] * (v - math.exp(sm[g_at + c]) * sm[at])
            for c in range(1, C):
                d = sm[uint32(x_at + c * dvp + j)]
                for c2 in range(c):
                    d -= sm[uint32(a_at + c * C + c2)] * sm[uint32(x_at + c2 * dvp + j)]
                sm[uint32(x_at + c * dvp + j)] = d

    @device_function
    def outputs(sm, out, r, n_c, o_row, o_base, dvp):
        """o_c = e^(G_c) S₀q_c + Σ P[c][c'] D[c'] to out (rows < n_c), then k rows scaled by
        e^(G_last − G_c) for the state update (P·D no longer reads them)."""
        col_tiles = dvp // 4
        for t in range(cuda.threadIdx.x, C // 4 * col_tiles, cuda.blockDim.x):
            r0, j0 = 4 * (t // col_tiles), 4 * (t % col_tiles)
            acc = cuda.local.array(16, float32)
            for m in range(4):
                g = math.exp(sm[g_at + r0 + m])
                for n in range(4):
                    acc[4 * m + n] = g * sm[x_at + (C + r0 + m) * dvp + j0 + n]
            for c2 in range(C):
                d = lds4(sm, uint32(x_at + c2 * dvp + j0))
                for m in range(4):
                    p = sm[uint32(p_at + (r0 + m) * C + c2)]
                    for n in range(4):
                        acc[4 * m + n] += p * d[n]
            for m in range(4):
                if r0 + m < n_c:
                    for n in range(4):
                        out[(r + r0 + m) * o_row + o_base + j0 + n] = acc[4 * m + n]
        g_last = sm[g_at + C - 1]
        for e in range(cuda.threadIdx.x, C * dk, cuda.blockDim.x):
            c = e // dk
            sm[c * kq_stride + e % dk] *= math.exp(g_last - sm[g_at + c])

    @device_function
    def update_state(sm, dvp):
        """S ← e^(G_last) S + Σ_c D[c] ⊗ k̃_c (the k rows already carry e^(G_last − G_c))."""
        col_tiles = dvp // 4
        g_last = math.exp(sm[g_at + C - 1])
        for t in range(cuda.threadIdx.x, dk // 4 * col_tiles, cuda.blockDim.x):
            i0, j0 = 4 * (t // col_tiles), 4 * (t % col_tiles)
            acc = cuda.local.array(16, float32)
            for m in range(4):
                s = lds4(sm, s_at + (i0 + m) * dvp + j0)
                for n in range(4):
                    acc[4 * m + n] = g_last * s[n]
            for c in range(C):
                d = lds4(sm, uint32(x_at + c * dvp + j0))
                for m in range(4):
                    k = sm[uint32(c * kq_stride + i0 + m)]
                    for n in range(4):
                        acc[4 * m + n] += k * d[n]
            for m in range(4):
                for n in range(4):
                    sm[s_at + (i0 + m) * dvp + j0 + n] = acc[4 * m + n]

    @device_function
    def move_state(state, sm, base, dvp, to_shared):
        """The part's columns of the state (global S[j][i]) into shared S[i][j], or back."""
        for e in range(cuda.threadIdx.x, dk * dvp, cuda.blockDim.x):
            j, i = e // dk, e % dk
            if to_shared:
                sm[s_at + i * dvp + j] = state[base + j * dk + i]
            else:
                state[base + j * dk + i] = sm[s_at + i * dvp + j]

    return load_chunk, token_products, state_products, solve_deltas, outputs, update_state, \
        move_state



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
def _chunk_kernel(dk: int, dv: int, C: int):
    load_chunk, token_products, state_products, solve_deltas, outputs, update_state, \
        move_state = _phases(dk, dv, C)

    @kernel(fastmath=True)
    def delta_chunked(u, a, b, state, state_slots, seq_lo, seq_n, n_k_heads, head_map_mod,
                      wide_pass, out):
        chain_start()
        n_v_heads = cuda.gridDim.x // PARTS
        h, part = cuda.blockIdx.x // PARTS, cuda.blockIdx.x % PARTS
        wide = _active_sequences(seq_n) * n_v_heads >= wide_pass
        if wide and part > 0:
            return
        dvp = dv if wide else dv // PARTS
        j0 = part * dvp
        sm = cuda.shared.array(0, float32)
        kh = h % n_k_heads if head_map_mod else h // (n_v_heads // n_k_heads)
        key_dim = n_k_heads * dk
        u_stride = 2 * key_dim + n_v_heads * dv
        q_off, k_off, v_off = kh * dk, key_dim + kh * dk, 2 * key_dim + h * dv + j0
        for seq in range(cuda.blockIdx.y, seq_n.size, cuda.gridDim.y):
            n = seq_n[seq]
            if n == 0:
                continue
            lo = seq_lo[seq]
            base = ((state_slots[seq] * n_v_heads + h) * dv + j0) * dk
            move_state(state, sm, base, dvp, True)
            for r in range(lo, lo + n, C):
                n_c = min(C, lo + n - r)
                load_chunk(u, a, b, sm, r, n_c, u_stride, q_off, k_off, h, n_v_heads)
                token_products(sm)
                state_products(sm, dvp)
                cuda.syncthreads()
                solve_deltas(u, sm, r, n_c, u_stride, v_off, dvp)
                cuda.syncthreads()
                outputs(sm, out, r, n_c, n_v_heads * dv, h * dv + j0, dvp)
                cuda.syncthreads()
                update_state(sm, dvp)
                cuda.syncthreads()
            move_state(state, sm, base, dvp, False)
            cuda.syncthreads()
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
    if not supports(dk, dv) or state.shape[1:3] != (n_v_heads, dv):
        raise ValueError(f"state {state.shape}: the chunked kernel takes dk ≤ {MAX_DK}, dk % 4 "
                         f"== 0 and dv % {4 * PARTS} == 0")
    if u.shape != (n_rows, 2 * n_k_heads * dk + n_v_heads * dv):
        raise ValueError(f"u {u.shape} is not (n_rows, 2·H_k·dk + H_v·dv)")
    check_array("a", a, np.float32, (n_rows, n_v_heads))
    check_array("b", b, np.float32, (n_rows, n_v_heads))
    n_seqs = seq_n.size
    _chunk_kernel(dk, dv, chunk)[(n_v_heads * PARTS, min(n_seqs, SEQ_BLOCKS)), THREADS, stream,
                                 4 * shared_floats(dk, dv, chunk)](
        u.reshape(u.size), a.reshape(a.size), b.reshape(b.size), state.reshape(state.size),
        state_slots, seq_lo, seq_n, n_k_heads, head_map_mod, wide_pass, out.reshape(out.size))
