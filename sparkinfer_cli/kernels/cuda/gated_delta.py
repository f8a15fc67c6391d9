"""Gated DeltaNet on the GPU: causal conv + SiLU, and the recurrent delta rule.

State layout per slot: conv (conv_dim, K-1) float32 (oldest sample first); recurrent
(H_v, dv, dk) float32 = S[h][j][i], i (the k index) contiguous, so the lanes owning value column j
read its dk rows coalesced (llama.cpp's ggml state has the same order: HF's S transposed).
Sequences address their state through state_slots[seq]. The *_step kernels run one token per
sequence; the *_seq kernels (what the model launches, prefill and decode) run each sequence's rows
seq_lo[s] .. + seq_n[s].
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from sparkinfer_cli.kernels.cuda import gated_delta_chunked
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import (
    IS_SIMULATOR,
    bits_to_f32,
    chain_start,
    ld_u32,
    ld_v4_u32,
)
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv, check_array
from sparkinfer_cli.kernels.cuda.runtime.warp import shfl_xor, warp_sum

THREADS = 32 if IS_SIMULATOR else 256  # conv kernels; the simulator runs a Python thread each
WARPS = 4

if IS_SIMULATOR:

    def rsqrt(x):
        return float32(1.0) / math.sqrt(x)

    def st_f32(arr, off, x):
        """Store a float32 at byte offset off of a float32 array."""
        arr[off // 4] = x

    def st_v4_f32(arr, off, x0, x1, x2, x3):
        """Store 4 float32 at byte offset off (16-byte aligned) of a float32 array."""
        i = off // 4
        arr[i], arr[i + 1], arr[i + 2], arr[i + 3] = x0, x1, x2, x3

else:
    from llvmlite import ir
    rsqrt = cuda.libdevice.rsqrtf
    from numba import types
    from numba.cuda.extending import intrinsic

    def _store(ptx: str, n: int):
        """Codegen of `ptx` storing n float32 args to byte offset args[1] of array args[0]."""
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, value=args[0])
            i64 = ir.IntType(64)
            addr = builder.add(builder.ptrtoint(ary.data, i64),
                               context.cast(builder, args[1], sig.args[1], types.int64))
            vals = [context.cast(builder, v, t, types.float32)
                    for v, t in zip(args[2:], sig.args[2:])]
            fn = ir.FunctionType(ir.VoidType(), [i64] + [ir.FloatType()] * n)
            constraint = ",".join(["l"] + ["f"] * n)
            builder.call(ir.InlineAsm(fn, ptx, constraint, side_effect=True), [addr] + vals)
            return context.get_dummy_value()
        return codegen

    def _is_store(arr, off) -> bool:
        return isinstance(arr, types.Array) and isinstance(off, types.Integer)

    @intrinsic
    def st_f32(typingctx, arr, off, x):
        if _is_store(arr, off):
            return types.void(arr, off, x), _store("st.global.f32 [$0], $1;", 1)

    @intrinsic
    def st_v4_f32(typingctx, arr, off, x0, x1, x2, x3):
        if _is_store(arr, off):
            return (types.void(arr, off, x0, x1, x2, x3),
                    _store("st.global.v4.f32 [$0], {$1, $2, $3, $4};", 4))


@kernel(fastmath=True)
def _conv_silu_kernel(mixed, conv_w, conv_state, state_slots, conv_dim, k_conv, out):
    chain_start()
    i = cuda.grid(1)
    if i >= mixed.size:
        return
    seq = i // conv_dim
    c = i - seq * conv_dim
    hist = (state_slots[seq] * conv_dim + c) * (k_conv - 1)
    x = mixed[i]
    acc = conv_w[c * k_conv + k_conv - 1] * x
    for t in range(k_conv - 1):
        acc += conv_w[c * k_conv + t] * conv_state[hist + t]
    for t in range(k_conv - 2):
        conv_state[hist + t] = conv_state[hist + t + 1]
    conv_state[hist + k_conv - 2] = x
    out[i] = acc / (float32(1.0) + math.exp(-acc))


def conv_silu_step(mixed, conv_w, conv_state, state_slots, out, stream=0) -> None:
    """mixed (n_seqs, conv_dim) → out = silu(causal_conv(state ⧺ mixed)); state shifts by one."""
    n_seqs, conv_dim = mixed.shape
    k_conv = conv_w.shape[1]
    check_array("conv_w", conv_w, np.float32, (conv_dim, k_conv))
    check_array("out", out, np.float32, mixed.shape)
    check_array("state_slots", state_slots, np.int32, (n_seqs,))
    if conv_state.shape[1:] != (conv_dim, k_conv - 1):
        raise ValueError(f"conv_state {conv_state.shape} is not (slots, {conv_dim}, {k_conv - 1})")
    _conv_silu_kernel[cdiv(mixed.size, THREADS), THREADS, stream](
        mixed.reshape(mixed.size), conv_w.reshape(conv_w.size), conv_state.reshape(conv_state.size),
        state_slots, conv_dim, k_conv, out.reshape(out.size))


@functools.cache
def _delta_kernel(dk: int, dv: int):
    per_lane = dk // 32

    @kernel(fastmath=True)
    def delta_step(u, a, b, ssm_a, dt_bias, state, state_slots, n_k_heads, head_map_mod, eps, out):
        chain_start()
        # u = conv output (n_seqs, q | k | v); a, b: (n_seqs, H_v) pre-activations of decay and beta
        h, seq = cuda.blockIdx.x, cuda.blockIdx.y
        n_v_heads = cuda.gridDim.x
        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        kh = h % n_k_heads if head_map_mod else h // (n_v_heads // n_k_heads)
        key_dim = n_k_heads * dk
        row = seq * (2 * key_dim + n_v_heads * dv)
        qv = cuda.local.array(per_lane, float32)  # (dk / 32,) this lane's rows i = lane + 32e
        kv = cuda.local.array(per_lane, float32)
        sq, sk = float32(0.0), float32(0.0)
        for e in range(per_lane):
            qv[e] = u[row + kh * dk + lane + 32 * e]
            kv[e] = u[row + key_dim + kh * dk + lane + 32 * e]
            sq += qv[e] * qv[e]
            sk += kv[e] * kv[e]
        q_scale = float32(1.0) / math.sqrt((warp_sum(sq) + eps) * float32(dk))
        k_scale = float32(1.0) / math.sqrt(warp_sum(sk) + eps)
        t = a[seq * n_v_heads + h] + dt_bias[h]
        softplus = t if t > float32(20.0) else math.log(float32(1.0) + math.exp(t))
        decay = math.exp(ssm_a[h] * softplus)
        beta = float32(1.0) / (float32(1.0) + math.exp(-b[seq * n_v_heads + h]))
        s_base = (state_slots[seq] * n_v_heads + h) * dv * dk
        j = cuda.blockIdx.z * WARPS + warp  # one value column per warp
        if j >= dv:
            return
        col = s_base + j * dk + lane
        proj = float32(0.0)
        for e in range(per_lane):
            proj += state[col + 32 * e] * decay * kv[e]
        delta = beta * (u[row + 2 * key_dim + h * dv + j] - warp_sum(proj) * k_scale)
        o = float32(0.0)
        for e in range(per_lane):
            s_new = state[col + 32 * e] * decay + kv[e] * k_scale * delta
            state[col + 32 * e] = s_new
            o += s_new * qv[e]
        o = warp_sum(o)
        if lane == 0:
            out[(seq * n_v_heads + h) * dv + j] = o * q_scale
    return delta_step


def delta_rule_step(u, a, b, ssm_a, dt_bias, state, state_slots, out, *, n_k_heads: int,
                    head_map_mod: bool, eps: float, stream=0) -> None:
    """One token of the gated delta rule per sequence; state (slots, H_v, dv, dk) updated in place.

    out (n_seqs, H_v, dv) = S_newᵀ q̂ / sqrt(dk), q̂/k̂ L2-normalised (x / sqrt(Σx² + eps)).
    head_map_mod: v-head h reads k-head h % H_k (qwen35*), else h // (H_v / H_k) (qwen3next).
    """
    n_seqs, n_v_heads, dv = out.shape
    dk = state.shape[3]
    if dk % 32 or state.shape[1:3] != (n_v_heads, dv):
        raise ValueError(f"state {state.shape} is not (slots, {n_v_heads}, {dv}, dk % 32 == 0)")
    if u.shape != (n_seqs, 2 * n_k_heads * dk + n_v_heads * dv):
        raise ValueError(f"u {u.shape} is not (n_seqs, 2·H_k·dk + H_v·dv)")
    check_array("a", a, np.float32, (n_seqs, n_v_heads))
    check_array("b", b, np.float32, (n_seqs, n_v_heads))
    _delta_kernel(dk, dv)[(n_v_heads, n_seqs, cdiv(dv, WARPS)), 32 * WARPS, stream](
        u.reshape(u.size), a.reshape(a.size), b.reshape(b.size), ssm_a, dt_bias,
        state.reshape(state.size), state_slots, n_k_heads, head_map_mod, float32(eps),
        out.reshape(out.size))


# ------------------------------------------------------------- whole sequences (prefill + decode)
# Sequence s owns rows seq_lo[s] .. seq_lo[s] + seq_n[s] − 1 of the token-major inputs (decode is
# the case seq_n = 1); entries with seq_n = 0 (the workspace pads to n_rows entries) are skipped.
# conv_seq: a block covers `rows` (≤ CONV_ROWS) consecutive rows × THREADS channels. It first maps
# its rows to their sequences in shared memory (scanning seq_lo / seq_n), then a thread walks its
# channel down the rows. A sequence's first row runs its first K − 1 rows (the ones that see the
# old conv state) and writes the new state, so only one thread ever touches a state row.
CONV_ROWS = 32


@functools.cache
def _conv_sequence_head(k_conv: int, snapshots: bool):
    """(silu, sequence_head): the latter runs a sequence's first K − 1 rows (they read the old
    state) and writes its new state; snapshots: the state after each row whose row_slots entry
    is a slot (≥ 0) there too."""
    n_hist = k_conv - 1

    @device_function
    def silu(x):
        return x / (float32(1.0) + math.exp(-x))

    @device_function
    def stream_at(mixed, hist, lo, i, conv_dim, c):
        """Element i of the sequence's input stream (old state ⧺ its rows) in channel c."""
        return hist[i] if i < n_hist else mixed[(lo + i - n_hist) * conv_dim + c]

    @device_function
    def sequence_head(mixed, w, conv_state, out, slot, lo, n, conv_dim, c, row_slots):
        hist = cuda.local.array(n_hist, float32)  # (K − 1,) old state, oldest first
        base = (slot * conv_dim + c) * n_hist
        for t in range(n_hist):
            hist[t] = conv_state[base + t]
        for d in range(min(n, n_hist)):
            acc = float32(0.0)
            for t in range(k_conv):
                acc += w[t] * stream_at(mixed, hist, lo, d + t, conv_dim, c)
            out[(lo + d) * conv_dim + c] = silu(acc)
        if snapshots:  # after row d the window is the stream's elements d + 1 .. d + K − 1
            for d in range(n):
                kept = row_slots[lo + d]
                if kept >= 0:
                    for t in range(n_hist):
                        conv_state[(kept * conv_dim + c) * n_hist + t] = \
                            stream_at(mixed, hist, lo, d + 1 + t, conv_dim, c)
        for t in range(n_hist):
            conv_state[base + t] = stream_at(mixed, hist, lo, n + t, conv_dim, c)

    return silu, sequence_head


@functools.cache
def _conv_seq_kernel(k_conv: int, snapshots: bool):
    """conv_seq; snapshots: the state after each row whose row_slots entry is a slot (≥ 0) is
    written to that slot too."""
    n_hist = k_conv - 1
    silu, sequence_head = _conv_sequence_head(k_conv, snapshots)

    @kernel(fastmath=True)
    def conv_seq(mixed, conv_w, conv_state, state_slots, seq_lo, seq_n, conv_dim, rows, out,
                 row_slots):
        chain_start()
        row_seq = cuda.shared.array(CONV_ROWS, int32)  # (rows,) sequence of each row, or −1
        tid = cuda.threadIdx.x
        r0 = cuda.blockIdx.y * rows
        if tid < rows:
            row_seq[tid] = -1
        cuda.syncthreads()
        for s in range(tid, seq_n.size, cuda.blockDim.x):
            for r in range(max(seq_lo[s], r0), min(seq_lo[s] + seq_n[s], r0 + rows)):
                row_seq[r - r0] = s
        cuda.syncthreads()
        c = cuda.blockIdx.x * cuda.blockDim.x + tid
        if c >= conv_dim:
            return
        w = cuda.local.array(k_conv, float32)  # (K,) tap 0 multiplies the oldest input
        for t in range(k_conv):
            w[t] = conv_w[c * k_conv + t]
        for i in range(rows):
            s = row_seq[i]
            if s < 0:
                continue
            r = r0 + i
            d = r - seq_lo[s]
            if d == 0:
                sequence_head(mixed, w, conv_state, out, state_slots[s], r, seq_n[s], conv_dim, c,
                              row_slots)
            elif d >= n_hist:
                acc = float32(0.0)
                for t in range(k_conv):
                    acc += w[t] * mixed[(r - n_hist + t) * conv_dim + c]
                out[r * conv_dim + c] = silu(acc)
    return conv_seq


def conv_silu_seq(mixed, conv_w, conv_state, state_slots, seq_lo, seq_n, out, stream=0,
                  row_state_slots=None) -> None:
    """mixed (n_rows, conv_dim) → out = silu(causal conv) per sequence; state advances by seq_n.
    row_state_slots (n_rows,) int32: the state after row r is also written to slot
    row_state_slots[r] where that is ≥ 0 (a check's states after its rows); None: nowhere."""
    n_rows, conv_dim = mixed.shape
    k_conv = conv_w.shape[1]
    n_seqs = seq_n.size
    check_array("conv_w", conv_w, np.float32, (conv_dim, k_conv))
    check_array("out", out, np.float32, mixed.shape)
    for name, arr in (("state_slots", state_slots), ("seq_lo", seq_lo), ("seq_n", seq_n)):
        check_array(name, arr, np.int32, (n_seqs,))
    if k_conv < 2 or conv_state.shape[1:] != (conv_dim, k_conv - 1):
        raise ValueError(f"conv_state {conv_state.shape} is not (slots, {conv_dim}, {k_conv - 1})")
    snapshots = row_state_slots is not None
    if snapshots:
        check_array("row_state_slots", row_state_slots, np.int32, (n_rows,))
    rows = min(CONV_ROWS, max(1, n_rows // 128))  # each block scans all n_seqs entries once
    _conv_seq_kernel(k_conv, snapshots)[(cdiv(conv_dim, THREADS), cdiv(n_rows, rows)), THREADS,
                                        stream](
        mixed.reshape(mixed.size), conv_w.reshape(conv_w.size), conv_state.reshape(conv_state.size),
        state_slots, seq_lo, seq_n, conv_dim, rows, out.reshape(out.size),
        row_state_slots if snapshots else seq_n)


# Layout of delta_seq: a value column j (dk state rows S[j][·]) lives in a group of 8 lanes, lane
# `sub` holding rows 4·(sub + 8m) + c (m < dk/32, c < 4), so state and q/k rows move as float4s
# and a column's dot products need 3 shuffles. A warp holds 4 columns, a block WARPS·4 of one head.
# The state stays in registers over the sequence; token r + 1's inputs load while r computes.
GROUP = 8  # lanes per value column
SEQ_BLOCKS = 64  # grid rows; block row y runs sequences y, y + 64, … (most of n_rows are padding)


@device_function
def _group_sum(v):
    for offset in (4, 2, 1):
        v += shfl_xor(v, offset)
    return v


if IS_SIMULATOR:

    @cuda.jit(device=True)
    def _ballot(pred, lane):
        bits = uint32(1 << lane) if pred else uint32(0)
        for offset in (16, 8, 4, 2, 1):
            bits |= shfl_xor(bits, offset)
        return bits

else:

    @device_function
    def _ballot(pred, lane):
        return cuda.ballot_sync(0xFFFFFFFF, pred)


@device_function
def _lanes_with_rows(seq_n, entry, lane):
    """Bit l set ⇔ lane l's sequence entry has rows (a warp checks 32 entries at once)."""
    return _ballot(entry < seq_n.size and seq_n[entry] > 0, lane)


def _delta_seq_blocks(dv: int) -> tuple[int, int]:
    """(warps per block, blocks per head): WARPS·4 columns a block, fewer when dv is small."""
    warps = min(WARPS, cdiv(dv, 4))
    return warps, cdiv(dv, 4 * warps)


@functools.cache
def _row_moves(dk: int):
    """Device functions moving this lane's per_lane = dk / 8 floats of a dk-row as float4s."""
    vecs = dk // 32  # float4s per lane per row

    @device_function
    def load_row(arr, off, x):
        """x ← this lane's per_lane floats of the row at byte offset off (lane part included)."""
        for m in range(vecs):
            w = ld_v4_u32(arr, off + 128 * m)
            for c in range(4):
                x[4 * m + c] = bits_to_f32(w[c])

    @device_function
    def store_row(arr, off, x):
        """The row at byte offset off (lane part included) ← this lane's per_lane floats x."""
        for m in range(vecs):
            st_v4_f32(arr, off + 128 * m, x[4 * m], x[4 * m + 1], x[4 * m + 2], x[4 * m + 3])

    @device_function
    def load_token(u, a, b, u_row, g_row, q_off, k_off, v_off, q, k):
        """q, k ← a token's key-head rows (u_row, g_row: byte offsets of its u and gate rows);
        returns its (v[j], a, b)."""
        load_row(u, u_row + q_off, q)
        load_row(u, u_row + k_off, k)
        return (bits_to_f32(ld_u32(u, u_row + v_off)), bits_to_f32(ld_u32(a, g_row)),
                bits_to_f32(ld_u32(b, g_row)))

    return load_row, store_row, load_token


@device_function
def _log_gates(ga, gb, neg_a, bias):
    """A token's (log-decay, beta) of one value head from its pre-activations a, b."""
    t = ga + bias
    soft = math.log(float32(1.0) + math.exp(min(t, float32(20.0))))  # both sides: no branch
    return neg_a * (t if t > float32(20.0) else soft), float32(1.0) / (float32(1.0) + math.exp(-gb))


@device_function
def _gates(ga, gb, neg_a, bias):
    """A token's (decay, beta) of one value head from its pre-activations a, b."""
    log_decay, beta = _log_gates(ga, gb, neg_a, bias)
    return math.exp(log_decay), beta


@device_function
def _split_dot(s, k, half):
    """Σ s·k over this lane's 2·half floats, as two partial sums (a shorter dependency chain)."""
    p0, p1 = float32(0.0), float32(0.0)
    for e in range(half):
        p0 += s[e] * k[e]
        p1 += s[half + e] * k[half + e]
    return p0 + p1


@functools.cache
def _token_step(dk: int, prepared: bool):
    """token_step: the delta rule for one token on this lane's part of a value column. prepared:
    q, k arrive L2-normalised (q also / sqrt(dk)) and a, b as decay, beta (prepare_delta_inputs),
    so a token costs the state's products alone."""
    per_lane = dk // 8
    half = per_lane // 2

    @device_function
    def token_step(s, q, k, v, ga, gb, neg_a, bias, eps):
        """Advance the state by one token; returns this column's output Sᵀq̂ / sqrt(dk)."""
        proj = _group_sum(_split_dot(s, k, half))
        if prepared:
            decay, kd = ga, gb * (v - ga * proj)  # δ
            q_scale = float32(1.0)
        else:
            sq, sk = float32(0.0), float32(0.0)
            for e in range(per_lane):
                sq += q[e] * q[e]
                sk += k[e] * k[e]
            sq, sk = _group_sum(sq), _group_sum(sk)
            decay, beta = _gates(ga, gb, neg_a, bias)
            k_scale = rsqrt(sk + eps)
            kd = beta * (v - decay * proj * k_scale) * k_scale  # δ·k_scale
            q_scale = rsqrt((sq + eps) * float32(dk))
        o = float32(0.0)
        for e in range(per_lane):
            s[e] = s[e] * decay + k[e] * kd
            o += s[e] * q[e]
        return _group_sum(o) * q_scale

    return token_step


@functools.cache
def _token_runner(dk: int, prepared: bool, snapshots: bool):
    """run_tokens: a column's state advanced over a sequence's rows, loads one token ahead;
    snapshots: the state after each row whose row_slots entry is a slot (≥ 0) stored there."""
    _, store_row, load_token = _row_moves(dk)
    token_step = _token_step(dk, prepared)

    @device_function
    def store_snapshot(snap, left, s):
        """snap = (state, row_slots, the sequence's last row, this lane's byte offset in a
        slot, a slot's bytes, whether this lane stores): s after the row `left` rows before the
        last goes to that row's slot, if it has one."""
        state, row_slots, last_row, col, slot_bytes, keep = snap
        slot = row_slots[last_row - left]
        if keep and slot >= 0:
            store_row(state, slot * slot_bytes + col, s)

    @device_function
    def step_and_prefetch(u, a, b, out, s, left, rows, lane_offs, store, gates, cur, nxt, snap):
        """Load the next token into buffers nxt while token `cur` updates s (and its output is
        stored); returns (tokens left, the next token's row offsets, its v / a / b)."""
        u_row, g_row, o_row = rows
        q_off, k_off, v_off, u_step, g_step, o_step = lane_offs
        neg_a, bias, eps = gates
        u_nxt, g_nxt = u_row + (u_step if left > 0 else 0), g_row + (g_step if left > 0 else 0)
        v_n, a_n, b_n = load_token(u, a, b, u_nxt, g_nxt, q_off, k_off, v_off, nxt[0], nxt[1])
        o = token_step(s, cur[0], cur[1], cur[2], cur[3], cur[4], neg_a, bias, eps)
        if store:
            st_f32(out, o_row, o)
        if snapshots:
            store_snapshot(snap, left, s)
        return left - 1, (u_nxt, g_nxt, o_row + o_step), v_n, a_n, b_n

    @device_function
    def run_tokens(u, a, b, out, s, n, u_row, g_row, o_row, lane_offs, store, gates, qa, ka, qb,
                   kb, snap):
        """s ← s advanced over n tokens from byte offsets u_row / g_row; outputs from o_row."""
        q_off, k_off, v_off = lane_offs[0], lane_offs[1], lane_offs[2]
        left, rows = n - 1, (u_row, g_row, o_row)  # left: tokens after the current one
        va, aa, ba = load_token(u, a, b, u_row, g_row, q_off, k_off, v_off, qa, ka)
        while True:  # two tokens a trip: one computes from buffer A while B loads, then swap
            left, rows, vb, ab, bb = step_and_prefetch(u, a, b, out, s, left, rows, lane_offs,
                                                       store, gates, (qa, ka, va, aa, ba), (qb, kb),
                                                       snap)
            if left < 0:
                return
            left, rows, va, aa, ba = step_and_prefetch(u, a, b, out, s, left, rows, lane_offs,
                                                       store, gates, (qb, kb, vb, ab, bb), (qa, ka),
                                                       snap)
            if left < 0:
                return

    return run_tokens


@functools.cache
def _delta_seq_kernel(dk: int, dv: int, prepared: bool, snapshots: bool):
    per_lane = dk // 8
    warps, col_blocks = _delta_seq_blocks(dv)
    load_row, store_row, _ = _row_moves(dk)
    run_tokens = _token_runner(dk, prepared, snapshots)

    @kernel(fastmath=True)
    def delta_seq(u, a, b, ssm_a, dt_bias, state, state_slots, seq_lo, seq_n, n_k_heads,
                  head_map_mod, eps, out, row_slots):
        chain_start()
        n_v_heads = cuda.gridDim.x // col_blocks
        h = cuda.blockIdx.x // col_blocks
        lane = cuda.threadIdx.x % 32
        sub = lane % GROUP
        j = ((cuda.blockIdx.x % col_blocks) * warps + cuda.threadIdx.x // 32) * 4 + lane // GROUP
        jc = min(j, dv - 1)  # columns past dv compute a copy of the last one and store nothing
        kh = h % n_k_heads if head_map_mod else h // (n_v_heads // n_k_heads)
        key_dim = n_k_heads * dk
        q_off = 4 * kh * dk + 16 * sub  # byte offsets within a u row, then row strides
        lane_offs = (q_off, q_off + 4 * key_dim, 4 * (2 * key_dim + h * dv + jc),
                     4 * (2 * key_dim + n_v_heads * dv), 4 * n_v_heads, 4 * n_v_heads * dv)
        gates = (ssm_a[h], dt_bias[h], eps)
        s = cuda.local.array(per_lane, float32)  # (per_lane,) S[j][4·(sub + 8m) + c]
        qa, ka = cuda.local.array(per_lane, float32), cuda.local.array(per_lane, float32)
        qb, kb = cuda.local.array(per_lane, float32), cuda.local.array(per_lane, float32)
        stride, busy = cuda.gridDim.y, uint32(0)
        slot_bytes = 4 * n_v_heads * dv * dk
        for seq in range(cuda.blockIdx.y, seq_n.size, stride):
            bit = seq // stride % 32  # this entry's bit of busy
            if bit == 0:  # one load a lane checks the next 32 entries (most are padding)
                busy = _lanes_with_rows(seq_n, seq + lane * stride, lane)
            if busy >> bit & 1:
                lo = seq_lo[seq]
                in_slot = 4 * ((h * dv + jc) * dk) + 16 * sub  # bytes
                col = state_slots[seq] * slot_bytes + in_slot
                load_row(state, col, s)
                run_tokens(u, a, b, out, s, seq_n[seq], lo * lane_offs[3],
                           lo * lane_offs[4] + 4 * h, 4 * ((lo * n_v_heads + h) * dv + j),
                           lane_offs, sub == 0 and j < dv, gates, qa, ka, qb, kb,
                           (state, row_slots, lo + seq_n[seq] - 1, in_slot, slot_bytes, j < dv))
                if j < dv:
                    store_row(state, col, s)
    return delta_seq


def delta_rule_seq(u, a, b, ssm_a, dt_bias, state, state_slots, seq_lo, seq_n, out, *,
                   n_k_heads: int, head_map_mod: bool, eps: float, prepare: bool = False,
                   chunks=None, row_state_slots=None, stream=0) -> None:
    """The gated delta rule over each sequence's rows (see delta_rule_step for the math).

    u (n_rows, 2·H_k·dk + H_v·dv), a/b (n_rows, H_v), out (n_rows, H_v, dv); state (slots, H_v,
    dv, dk) of slot state_slots[s] advances over rows seq_lo[s] .. + seq_n[s].
    prepare: first compute what depends on one token alone (q/k norms, decay, beta) for every
    row at once, over u's q/k and a, b in place (they are then spent), so that the recurrence,
    one token after another, does only the state's products: about half its instructions a
    token, for one launch more (passes of multi-token sequences).
    chunks (a gated_delta_chunked.ChunkedPass; with prepare, where gated_delta_chunked supports
    the head size): the recurrence a chunk of tokens at a time, as products of matrices, in two
    kernels (the sequence entries with rows first). row_state_slots (n_rows,) int32 (not
    with prepare): the state after row r is also written to slot row_state_slots[r] where that
    is ≥ 0 (a check's states after its rows); None: nowhere."""
    n_rows, n_v_heads, dv = out.shape
    dk = state.shape[3]
    n_seqs = seq_n.size
    if dk % 32 or state.shape[1:3] != (n_v_heads, dv):
        raise ValueError(f"state {state.shape} is not (slots, {n_v_heads}, {dv}, dk % 32 == 0)")
    if u.shape != (n_rows, 2 * n_k_heads * dk + n_v_heads * dv):
        raise ValueError(f"u {u.shape} is not (n_rows, 2·H_k·dk + H_v·dv)")
    check_array("a", a, np.float32, (n_rows, n_v_heads))
    check_array("b", b, np.float32, (n_rows, n_v_heads))
    if (n_v_heads * dv) % 4 or u.size * 4 >= 2**31:
        raise ValueError(f"u {u.shape}: H_v·dv must be a multiple of 4 and u under 2 GiB")
    if prepare and chunks is not None and gated_delta_chunked.supports(dk, dv):
        _prepare_inputs(u, a, b, ssm_a, dt_bias, n_k_heads, dk, eps, stream, log_decay=True)
        gated_delta_chunked.delta_rule_chunked(u, a, b, state, state_slots, seq_lo, seq_n, out,
                                               chunks, n_k_heads=n_k_heads,
                                               head_map_mod=head_map_mod, stream=stream)
        return
    snapshots = row_state_slots is not None
    if snapshots:
        if prepare:
            raise ValueError("row_state_slots: passes of decodes' rows only (prepare=False)")
        check_array("row_state_slots", row_state_slots, np.int32, (n_rows,))
    if prepare:
        _prepare_inputs(u, a, b, ssm_a, dt_bias, n_k_heads, dk, eps, stream)
    warps, col_blocks = _delta_seq_blocks(dv)
    _delta_seq_kernel(dk, dv, prepare, snapshots)[
        (n_v_heads * col_blocks, min(n_seqs, SEQ_BLOCKS)), 32 * warps, stream](
        u.reshape(u.size), a.reshape(a.size), b.reshape(b.size), ssm_a, dt_bias,
        state.reshape(state.size), state_slots, seq_lo, seq_n, n_k_heads, head_map_mod,
        float32(eps), out.reshape(out.size), row_state_slots if snapshots else seq_n)


PREPARE_WARPS = 4


@kernel(fastmath=True)
def _prepare_kernel(u, a, b, ssm_a, dt_bias, n_rows, n_k_heads, dk, eps, log_decay):
    chain_start()
    # a warp per (row, head j of q | k): j < H_k scales q head j by 1 / sqrt((Σq² + eps)·dk),
    # the others k head j − H_k by 1 / sqrt(Σk² + eps); warp j = 0 of a row also turns the row's
    # a, b into each value head's decay (or its log), beta
    lane = cuda.threadIdx.x % 32
    n_heads = 2 * n_k_heads
    w = cuda.blockIdx.x * PREPARE_WARPS + cuda.threadIdx.x // 32
    if w >= n_rows * n_heads:
        return
    row, j = w // n_heads, w % n_heads
    base = row * (u.size // n_rows) + j * dk
    ss = float32(0.0)
    for i in range(lane, dk, 32):
        ss += u[base + i] * u[base + i]
    ss = warp_sum(ss)
    scale = rsqrt((ss + eps) * float32(dk)) if j < n_k_heads else rsqrt(ss + eps)
    for i in range(lane, dk, 32):
        u[base + i] *= scale
    if j == 0:
        n_v_heads = a.size // n_rows
        for h in range(lane, n_v_heads, 32):
            at = row * n_v_heads + h
            decay, beta = _log_gates(a[at], b[at], ssm_a[h], dt_bias[h])
            a[at] = decay if log_decay else math.exp(decay)
            b[at] = beta


def _prepare_inputs(u, a, b, ssm_a, dt_bias, n_k_heads: int, dk: int, eps: float,
                    stream, log_decay: bool = False) -> None:
    n_rows = u.shape[0]
    n_warps = n_rows * 2 * n_k_heads
    _prepare_kernel[cdiv(n_warps, PREPARE_WARPS), 32 * PREPARE_WARPS, stream](
        u.reshape(u.size), a.reshape(a.size), b.reshape(b.size), ssm_a, dt_bias, n_rows,
        n_k_heads, dk, float32(eps), log_decay)
