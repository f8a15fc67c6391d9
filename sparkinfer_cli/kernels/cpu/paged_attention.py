"""Softmax attention of query rows over a paged K/V cache layer: one native kernel (LLVM IR through
llvm_jit) per row, the rows of a pass split between the threads by parallel_calls.

Every new token of a pass (decode token, draft or prompt token) attends on its own, over exactly
the keys before it, through this one compiled kernel, whichever thread runs it: a row's numbers
never depend on what else shares its pass (layers.Attention.attend says why that matters).

Per row, for query head h of KV head g = h // (H / H_kv), over positions t < length:

    scores  s[h, t] = q_h · K[t, g] / √D     8 positions at a time: 8 vector accumulators over
                                             D, summed across lanes by one transposing tree
    softmax p[h, t] = exp(s - max_t s) / Σ   a vectorized exp (Cephes' polynomial, ≤ 2 ulp),
                                             sums in a fixed lane order
    output  o[h] = Σ_t p[h, t] · V[t, g]     up to 64 dims of o in registers per pass over t

The scores of a row live in a scratch of H × (length rounded up to 8) floats, one per thread.
Shapes (H, H_kv, D, block size) are constants of the compiled kernel; D need not be a multiple of
8 (its last lanes are loaded and stored masked).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import njit

from sparkinfer_cli.kernels.cpu import parallel_calls, quant
from sparkinfer_cli.kernels.cpu.ir_vectors import (
    DECLARATIONS,
    ELEMENTS,
    W,
    broadcast,
    exp,
    ints,
    load,
    splat,
    store,
)

_CHUNKS_PER_PASS = 8  # vectors of o kept in registers over one pass over the positions
_OUT_BLOCK = 64  # positions whose V rows one KV head's query heads read in turn
# A pass's rows are split between the threads once each thread gets this many q·K and p·V
# multiply-adds: parallel_calls hands off in microseconds, and a decode row of a 135M model at
# position 100 is ~60 K.
_MIN_MACS_PER_PART = 1 << 17


class Shape(NamedTuple):
    n_head: int
    n_head_kv: int
    head_dim: int
    block_size: int
    kv: str  # the cache's element type: "float" (float32) or "half" (float16)

    @property
    def row_values(self) -> int:
        """K (or V) values of one position: all its KV heads."""
        return self.n_head_kv * self.head_dim

    @property
    def group(self) -> int:
        return self.n_head // self.n_head_kv

    def widths(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(offset, lanes) of the vectors covering dims lo..hi-1 of a head."""
        return [(d, min(W, hi - d)) for d in range(lo, hi, W)]


def _row_offset(shape: Shape, name: str, t: str) -> str:
    """IR: i64 %name = element offset of position t's K/V row (all its KV heads) in the layer."""
    return (f"  %{name}b = udiv i64 {t}, {shape.block_size}\n"
            f"  %{name}s = urem i64 {t}, {shape.block_size}\n"
            f"  %{name}bp = getelementptr i32, ptr %bt, i64 %{name}b\n"
            f"  %{name}bi = load i32, ptr %{name}bp, align 4\n"
            f"  %{name}bw = sext i32 %{name}bi to i64\n"
            f"  %{name}r0 = mul i64 %{name}bw, {shape.block_size}\n"
            f"  %{name}r1 = add i64 %{name}r0, %{name}s\n"
            f"  %{name} = mul i64 %{name}r1, {shape.row_values}\n")


def _prefetch_row(shape: Shape, base: str, offset: str, name: str) -> str:
    """IR: prefetch the cache lines of the K/V row at element offset `offset` from base (the
    next tile's rows, while this one computes: the rows of a long context come from DRAM)."""
    ir = f"  %{name}p = getelementptr {shape.kv}, ptr {base}, i64 {offset}\n"
    for line in range(0, ELEMENTS[shape.kv][2] * shape.row_values, 64):
        ir += (f"  %{name}l{line} = getelementptr i8, ptr %{name}p, i64 {line}\n"
               f"  call void @llvm.prefetch.p0(ptr %{name}l{line}, i32 0, i32 3, i32 1)\n")
    return ir


def _lane_sums(acc: list[str], out: str) -> str:
    """IR: %out lane j = Σ lanes of acc[j], for 8 accumulators (a transposing tree of
    shuffles and adds: pairs, then quads, then halves)."""
    ir, level, n = "", acc, 0
    masks = [([0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]),
             ([0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]),
             ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])]
    for lo, hi in masks:
        nxt = []
        for a, b in zip(level[::2], level[1::2]):
            name = f"%{out}_{n}"
            n += 1
            ir += (f"  {name}l = shufflevector <8 x float> {a}, <8 x float> {b}, "
                   f"<8 x i32> {ints(lo)}\n"
                   f"  {name}h = shufflevector <8 x float> {a}, <8 x float> {b}, "
                   f"<8 x i32> {ints(hi)}\n"
                   f"  {name} = fadd <8 x float> {name}l, {name}h\n")
            nxt.append(name)
        level = nxt
    return ir + f"  %{out} = fadd <8 x float> {level[0]}, zeroinitializer\n"


def _tile_rows(shape: Shape) -> str:
    """IR: %ko{j}, the offsets of the tile's 8 K rows (past the length: the last row's), and
    prefetches of the next tile's."""
    return "".join(f"  %t{j} = add i64 %tile, {j}\n"
                   f"  %tc{j} = call i64 @llvm.umin.i64(i64 %t{j}, i64 %last)\n"
                   + _row_offset(shape, f"ko{j}", f"%tc{j}")
                   + f"  %tn{j} = add i64 %tile, {W + j}\n"
                   f"  %tnc{j} = call i64 @llvm.umin.i64(i64 %tn{j}, i64 %last)\n"
                   + _row_offset(shape, f"kf{j}", f"%tnc{j}")
                   + _prefetch_row(shape, "%k", f"%kf{j}", f"kf{j}") for j in range(W))


def _score_dots(shape: Shape) -> str:
    """IR: <8 x float> %dot, lane j = q_h · (KV head g of the tile's row j): 8 accumulators
    over the head's dims, then summed across lanes."""
    dots = ""
    for d, width in shape.widths(0, shape.head_dim):
        dots += (f"  %qp{d} = getelementptr float, ptr %qh, i64 {d}\n" + load(f"q{d}", f"%qp{d}",
                                                                             width))
        for j in range(W):
            prev = f"%a{j}_{d - W}" if d else "zeroinitializer"
            dots += (f"  %kq{j}_{d} = getelementptr {shape.kv}, ptr %kp{j}, i64 {d}\n"
                     + load(f"k{j}_{d}", f"%kq{j}_{d}", width, shape.kv)
                     + f"  %a{j}_{d} = call <8 x float> @llvm.fma.v8f32(<8 x float> %q{d}, "
                     f"<8 x float> %k{j}_{d}, <8 x float> {prev})\n")
    last_d = shape.widths(0, shape.head_dim)[-1][0]
    return dots + _lane_sums([f"%a{j}_{last_d}" for j in range(W)], "dot")


def _scores(shape: Shape) -> str:
    """IR blocks: scratch[h, t] = s[h, t] (lanes past the length -inf), per tile of 8 positions
    (their K rows read once, in the cache's order) and KV head g, the tile's rows of g read
    once for the group's query heads."""
    heads = "".join(f"  %kg{j} = add i64 %ko{j}, %gd\n"
                    f"  %kp{j} = getelementptr {shape.kv}, ptr %k, i64 %kg{j}\n" for j in range(W))
    scale = splat(1.0 / np.sqrt(shape.head_dim))
    return f"""  br label %st
st:
  %tile = phi i64 [0, %entry], [%tilen, %stnext]
{_tile_rows(shape)}  %tilei = trunc i64 %tile to i32
{broadcast("tilev", "%tilei", "i32")}  %tv = add <8 x i32> %tilev, {ints(list(range(W)))}
  %live = icmp ult <8 x i32> %tv, %lenv
  br label %sg
sg:
  %g = phi i64 [0, %st], [%gn, %sgnext]
  %gd = mul i64 %g, {shape.head_dim}
{heads}  %hl0 = mul i64 %g, {shape.group}
  %hl1 = add i64 %hl0, {shape.group}
  br label %sh
sh:
  %h = phi i64 [%hl0, %sg], [%hn, %sh]
  %qo = mul i64 %h, {shape.head_dim}
  %qh = getelementptr float, ptr %q, i64 %qo
{_score_dots(shape)}\
  %sc = fmul <8 x float> %dot, {scale}
  %sm = select <8 x i1> %live, <8 x float> %sc, <8 x float> {splat(-np.inf)}
  %so0 = mul i64 %h, %lp
  %so = add i64 %so0, %tile
  %sp = getelementptr float, ptr %scr, i64 %so
  store <8 x float> %sm, ptr %sp, align 4
  %hn = add i64 %h, 1
  %hc = icmp ult i64 %hn, %hl1
  br i1 %hc, label %sh, label %sgnext
sgnext:
  %gn = add i64 %g, 1
  %gc = icmp ult i64 %gn, {shape.n_head_kv}
  br i1 %gc, label %sg, label %stnext
stnext:
  %tilen = add i64 %tile, {W}
  %tc = icmp ult i64 %tilen, %len
  br i1 %tc, label %st, label %softmax
"""


def _softmax() -> str:
    """IR blocks: per head h, its scratch row ← exp(s - max s), and sums[h] ← 1 / Σ of them
    (sums: the H floats after the scores)."""
    return f"""softmax:
  br label %mh
mh:
  %h2 = phi i64 [0, %softmax], [%h2n, %enext]
  %ro = mul i64 %h2, %lp
  %row = getelementptr float, ptr %scr, i64 %ro
  br label %mt
mt:
  %mi = phi i64 [0, %mh], [%min, %mt]
  %mx0 = phi <8 x float> [{splat(-np.inf)}, %mh], [%mx1, %mt]
  %mp = getelementptr float, ptr %row, i64 %mi
  %mv = load <8 x float>, ptr %mp, align 4
  %mx1 = call <8 x float> @llvm.maxnum.v8f32(<8 x float> %mx0, <8 x float> %mv)
  %min = add i64 %mi, {W}
  %mc = icmp ult i64 %min, %len
  br i1 %mc, label %mt, label %mdone
mdone:
  %mxs = call float @llvm.vector.reduce.fmax.v8f32(<8 x float> %mx1)
{broadcast("mxv", "%mxs")}  br label %et
et:
  %ei = phi i64 [0, %mdone], [%ein, %et]
  %es0 = phi <8 x float> [zeroinitializer, %mdone], [%es1, %et]
  %ep = getelementptr float, ptr %row, i64 %ei
  %ev = load <8 x float>, ptr %ep, align 4
  %ex = fsub <8 x float> %ev, %mxv
{exp("%ex", "pe")}  store <8 x float> %pe, ptr %ep, align 4
  %es1 = fadd <8 x float> %es0, %pe
  %ein = add i64 %ei, {W}
  %ec = icmp ult i64 %ein, %len
  br i1 %ec, label %et, label %enext
enext:
  %tot = call float @llvm.vector.reduce.fadd.v8f32(float -0.0, <8 x float> %es1)
  %inv = fdiv float 1.0, %tot
  %ivp = getelementptr float, ptr %sums, i64 %h2
  store float %inv, ptr %ivp, align 4
  %h2n = add i64 %h2, 1
  %h2c = icmp ult i64 %h2n, %nh
  br i1 %h2c, label %mh, label %output
"""


def _output_pass(shape: Shape, i: int, vecs: list[tuple[int, int]], pred: str) -> str:
    """IR: pass i over the block's positions for dims `vecs` of head h3: from block `pred`,
    accumulators (out's values, or 0 at the first block) over the positions, then stored
    (scaled after the last block); ends in block od{i}."""
    starts = "".join(f"  %oi{i}_{d} = getelementptr float, ptr %oh_p, i64 {d}\n"
                     + load(f"ol{i}_{d}", f"%oi{i}_{d}", width)
                     + f"  %c{i}_{d}0 = select i1 %first, <8 x float> zeroinitializer, "
                     f"<8 x float> %ol{i}_{d}\n" for d, width in vecs)
    phis = "".join(f"  %c{i}_{d} = phi <8 x float> [%c{i}_{d}0, %{pred}], "
                   f"[%c{i}_{d}n, %ot{i}]\n" for d, _ in vecs)
    fmas = "".join(f"  %vq{i}_{d} = getelementptr {shape.kv}, ptr %vr{i}, i64 {d}\n"
                   + load(f"v{i}_{d}", f"%vq{i}_{d}", width, shape.kv)
                   + f"  %c{i}_{d}n = call <8 x float> @llvm.fma.v8f32(<8 x float> %pv{i}, "
                   f"<8 x float> %v{i}_{d}, <8 x float> %c{i}_{d})\n" for d, width in vecs)
    stores = "".join(f"  %on{i}_{d} = fmul <8 x float> %c{i}_{d}n, %ivv\n"
                     + store(f"%on{i}_{d}", f"%oi{i}_{d}", width) for d, width in vecs)
    return f"""{starts}  br label %ot{i}
ot{i}:
  %ti{i} = phi i64 [%tb, %{pred}], [%ti{i}n, %ot{i}]
{phis}  %pp{i} = getelementptr float, ptr %prow, i64 %ti{i}
  %ps{i} = load float, ptr %pp{i}, align 4
{broadcast(f"pv{i}", f"%ps{i}")}  %ri{i} = sub i64 %ti{i}, %tb
  %rq{i} = getelementptr i64, ptr %vrows, i64 %ri{i}
  %vo{i} = load i64, ptr %rq{i}, align 8
  %vr{i} = getelementptr {shape.kv}, ptr %vg, i64 %vo{i}
{fmas}  %ti{i}n = add i64 %ti{i}, 1
  %more{i} = icmp ult i64 %ti{i}n, %tend
  br i1 %more{i}, label %ot{i}, label %od{i}
od{i}:
{stores}"""


def _output(shape: Shape) -> str:
    """IR blocks: o[h] = (Σ_t p[h, t] V[t, g]) / Σ. Per KV head, positions in blocks of
    _OUT_BLOCK (their V rows stay in cache for the group's heads and every pass); per head, up
    to 64 dims of o in registers per pass over a block, added to what earlier blocks left in
    out, scaled by 1/Σ after the last block."""
    ir = f"""output:
  br label %ob
ob:
  %tb = phi i64 [0, %output], [%tbn, %obnext]
  %tb1 = add i64 %tb, {_OUT_BLOCK}
  %tend = call i64 @llvm.umin.i64(i64 %tb1, i64 %len)
  %first = icmp eq i64 %tb, 0
  %final = icmp eq i64 %tend, %len
  br label %orow
orow:
  %tr = phi i64 [%tb, %ob], [%trn, %orow]
{_row_offset(shape, "vo", "%tr")}  %ri = sub i64 %tr, %tb
  %rp = getelementptr i64, ptr %vrows, i64 %ri
  store i64 %vo, ptr %rp, align 8
  %trn = add i64 %tr, 1
  %trc = icmp ult i64 %trn, %tend
  br i1 %trc, label %orow, label %og
og:
  %g3 = phi i64 [0, %orow], [%g3n, %ognext]
  %g3d = mul i64 %g3, {shape.head_dim}
  %vg = getelementptr {shape.kv}, ptr %v, i64 %g3d
  %hg0 = mul i64 %g3, {shape.group}
  %hg1 = add i64 %hg0, {shape.group}
  br label %oh
oh:
  %h3 = phi i64 [%hg0, %og], [%h3n, %ohnext]
  %pro = mul i64 %h3, %lp
  %prow = getelementptr float, ptr %scr, i64 %pro
  %ivp3 = getelementptr float, ptr %sums, i64 %h3
  %iv3 = load float, ptr %ivp3, align 4
  %mult = select i1 %final, float %iv3, float 1.0
{broadcast("ivv", "%mult")}  %oo = mul i64 %h3, {shape.head_dim}
  %oh_p = getelementptr float, ptr %out, i64 %oo
"""
    for i, lo in enumerate(range(0, shape.head_dim, W * _CHUNKS_PER_PASS)):
        hi = min(lo + W * _CHUNKS_PER_PASS, shape.head_dim)
        ir += _output_pass(shape, i, shape.widths(lo, hi), "oh" if i == 0 else f"od{i - 1}")
    return ir + f"""  br label %ohnext
ohnext:
  %h3n = add i64 %h3, 1
  %h3c = icmp ult i64 %h3n, %hg1
  br i1 %h3c, label %oh, label %ognext
ognext:
  %g3n = add i64 %g3, 1
  %g3c = icmp ult i64 %g3n, {shape.n_head_kv}
  br i1 %g3c, label %og, label %obnext
obnext:
  %tbn = add i64 %tb, {_OUT_BLOCK}
  %tbc = icmp ult i64 %tbn, %len
  br i1 %tbc, label %ob, label %done
done:
  ret void
"""


def _kernel_ir(shape: Shape) -> str:
    """void attend(q, k, v, block_table, length, out, scratch, 4 unused): out (H, D) = softmax
    attention of q (H, D) over positions 0..length-1 of the layer k, v (block, slot, H_kv, D)
    through block_table (int32); scratch: H · (roundup(length, 8) + 1) floats."""
    head = parallel_calls.kernel_head("attend", ["*q", "*k", "*v", "*bt", "len", "*out", "*scr"])
    return f"""{DECLARATIONS}
{head}  %nh = add i64 0, {shape.n_head}
  %last = sub i64 %len, 1
  %lp0 = add i64 %len, {W - 1}
  %lp = and i64 %lp0, {-W}
  %so_end = mul i64 %lp, {shape.n_head}
  %sums = getelementptr float, ptr %scr, i64 %so_end
  %vrows = alloca [{_OUT_BLOCK} x i64], align 8
  %len32 = trunc i64 %len to i32
{broadcast("lenv", "%len32", "i32")}{_scores(shape)}{_softmax()}{_output(shape)}}}
"""


@functools.cache
def _kernel(shape: Shape) -> int:
    return parallel_calls.compile_kernel(_kernel_ir(shape), "attend")


def _store_ir(shape: Shape) -> str:
    """void store(k_new, v_new, k, v, blocks, slots, n, k_stride, v_stride, 2 unused): row i
    of k_new (its H_kv·D values contiguous, rows k_stride floats apart) into k[blocks[i],
    slots[i]] in the cache's element type (float16: rounded to nearest even), v_new into v."""
    copies = ""
    for name in ("k", "v"):
        copies += (f"  %{name}so = mul i64 %i, %{name}st\n"
                   f"  %{name}src = getelementptr float, ptr %{name}n, i64 %{name}so\n"
                   f"  %{name}dst = getelementptr {shape.kv}, ptr %{name}, i64 %dsto\n")
        for e, width in [(e, min(W, shape.row_values - e)) for e in range(0, shape.row_values, W)]:
            copies += (f"  %{name}s{e} = getelementptr float, ptr %{name}src, i64 {e}\n"
                       + load(f"{name}x{e}", f"%{name}s{e}", width)
                       + f"  %{name}d{e} = getelementptr {shape.kv}, ptr %{name}dst, i64 {e}\n"
                       + store(f"%{name}x{e}", f"%{name}d{e}", width, shape.kv))
    return f"""{DECLARATIONS}
{parallel_calls.kernel_head("store", ["*kn", "*vn", "*k", "*v", "*blocks", "*slots", "n", "kst",
                                        "vst"])}  %any = icmp sgt i64 %n, 0
  br i1 %any, label %row, label %done
row:
  %i = phi i64 [0, %entry], [%in, %row]
  %bp = getelementptr i64, ptr %blocks, i64 %i
  %b = load i64, ptr %bp, align 8
  %sp = getelementptr i64, ptr %slots, i64 %i
  %sl = load i64, ptr %sp, align 8
  %r0 = mul i64 %b, {shape.block_size}
  %r1 = add i64 %r0, %sl
  %dsto = mul i64 %r1, {shape.row_values}
{copies}  %in = add i64 %i, 1
  %more = icmp slt i64 %in, %n
  br i1 %more, label %row, label %done
done:
  ret void
}}
"""


@functools.cache
def _store_kernel(shape: Shape) -> int:
    return parallel_calls.compile_kernel(_store_ir(shape), "store")


KV_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "half"}


# a call record's fields (parallel_calls): the kernel, then its arguments
_FN, _Q, _K, _V, _TABLE, _LENGTH, _OUT, _SCRATCH = range(8)  # attend
_K_NEW, _V_NEW, _K_LAYER, _V_LAYER, _BLOCKS, _SLOTS, _ROWS, _K_STRIDE, _V_STRIDE = range(1, 10)


@njit(cache=True, nogil=True)
def _bind(calls, store, q, out, k_new, v_new, k_at, v_at):
    """Points a pass's records at one layer's arrays: row i's query and output, the cache
    layer (k_at, v_at) and the new rows (numba reads the addresses faster than numpy does)."""
    row_bytes = 4 * q.shape[1] * q.shape[2]
    q_at, out_at = q.ctypes.data, out.ctypes.data
    for i in range(calls.shape[0]):
        calls[i, _Q], calls[i, _OUT] = q_at + i * row_bytes, out_at + i * row_bytes
        calls[i, _K], calls[i, _V] = k_at, v_at
    store[0, _K_NEW], store[0, _V_NEW] = k_new.ctypes.data, v_new.ctypes.data
    store[0, _K_LAYER], store[0, _V_LAYER] = k_at, v_at


class _Job:
    """A pass's calls for one cache and shape of its inputs: the store record, then the rows'
    attention records (split into parts of about equal q·K + p·V work, one per thread, at least
    _MIN_MACS_PER_PART each, each part with its own scores scratch); _bind fills in what
    changes from layer to layer."""

    def __init__(self, rows: PassRows, shape: Shape, new_strides: tuple[int, int], k: np.ndarray,
                 v: np.ndarray):
        n = len(rows)
        self.store = np.zeros((1, parallel_calls.CALL_FIELDS), np.int64)
        self.store[0, [_FN, _BLOCKS, _SLOTS, _ROWS, _K_STRIDE, _V_STRIDE]] = [
            _store_kernel(shape), rows.blocks.ctypes.data,
            rows.slots.ctypes.data, n, new_strides[0] // 4, new_strides[1] // 4]
        work = np.cumsum(rows.lengths)  # (n,)
        macs = 2 * shape.n_head * shape.head_dim * int(work[-1])
        n_parts = max(1, min(quant._num_threads(), macs // _MIN_MACS_PER_PART, n))
        ends = np.searchsorted(work, work[-1] * np.arange(1, n_parts + 1) / n_parts, "left") + 1
        ends[-1] = n
        padded = (rows.lengths + W - 1) // W * W
        stride = shape.n_head * (int(padded.max()) + 1)  # floats of one part's scratch
        self.scratch = np.empty((n_parts, stride), np.float32)
        part = np.repeat(np.arange(n_parts), np.diff(ends, prepend=0))  # (n,) each row's part
        self.calls = np.zeros((n, parallel_calls.CALL_FIELDS), np.int64)
        self.calls[:, _FN] = _kernel(shape)
        self.calls[:, _TABLE] = rows.table_at
        self.calls[:, _LENGTH] = rows.lengths
        self.calls[:, _SCRATCH] = self.scratch.ctypes.data + 4 * stride * part
        self.part_ends = ends.astype(np.int64)
        self.store_end = np.ones(1, np.int64)
        self.at = [a.ctypes.data for a in (self.store, self.store_end, self.calls, self.part_ends)]
        self.k_at, self.v_at = k.ctypes.data, v.ctypes.data
        self.layer_bytes = k[0].nbytes

    def run(self, q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, layer: int) -> np.ndarray:
        out = np.empty_like(q)  # (N, H, D)
        offset = layer * self.layer_bytes
        _bind(self.calls, self.store, q, out, k_new, v_new, self.k_at + offset,
              self.v_at + offset)
        store_at, store_end_at, calls_at, ends_at = self.at
        parallel_calls.run_parts_at(store_at, store_end_at, 1)
        parallel_calls.run_parts_at(calls_at, ends_at, len(self.part_ends))
        return out


class PassRows:
    """The query rows of one forward pass, in order: row i is the token at positions[i] of the
    sequence with block table tables[i]; it attends over positions 0..positions[i]."""

    def __init__(self, tables: list[np.ndarray], positions: np.ndarray, block_size: int):
        if len(tables) != len(positions):
            raise ValueError(f"{len(positions)} rows but {len(tables)} block tables")
        self._tables = {id(t): np.ascontiguousarray(t, np.int32) for t in tables}  # alive
        own = [self._tables[id(t)] for t in tables]
        positions = np.asarray(positions, np.int64)
        self.lengths = positions + 1
        self.slots = positions % block_size
        self.blocks = np.array([t[p // block_size] for t, p in zip(own, positions.tolist())],
                               np.int64)
        self.table_at = np.array([t.ctypes.data for t in own], np.int64)
        self.jobs: dict[tuple, _Job] = {}  # by what decides the records (attend's key)

    def __len__(self) -> int:
        return len(self.lengths)


def attend(q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, k: np.ndarray, v: np.ndarray,
           layer: int, rows: PassRows) -> np.ndarray:
    """Stores row i's k_new, v_new (N, H_kv, D) at its own position of cache layer `layer` of
    k, v (layer, block, slot, H_kv, D), then returns out (N, H, D): row i's query q[i] (H, D)
    attended over its positions 0..positions[i] (query head h reads KV head h // (H / H_kv)).
    Every row's k, v are stored before any row attends."""
    job = rows.jobs.get(_job_key(q, k_new, v_new, k, v))
    if job is None:  # the pass's first layer, or arrays the kernels cannot take as they are
        shape = _shape(q, k_new, v_new, k, v, len(rows))
        q = np.ascontiguousarray(q, np.float32)
        k_new, v_new = (x if x.dtype == np.float32 and x.strides[1:] == (4 * shape.head_dim, 4)
                        else np.ascontiguousarray(x, np.float32) for x in (k_new, v_new))
        key = _job_key(q, k_new, v_new, k, v)
        if key not in rows.jobs:
            rows.jobs[key] = _Job(rows, shape, (k_new.strides[0], v_new.strides[0]), k, v)
        job = rows.jobs[key]
    if not 0 <= layer < len(k):
        raise ValueError(f"layer {layer} of a cache of {len(k)}")
    return job.run(q, k_new, v_new, layer)


def _job_key(q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, k: np.ndarray,
             v: np.ndarray) -> tuple:
    """What a pass's records depend on besides its rows (the cache arrays live as long as the
    pass, so their ids stand for them)."""
    return (q.shape, q.dtype, q.strides, k_new.dtype, k_new.strides, v_new.dtype, v_new.strides,
            id(k), id(v))


def _shape(q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, k: np.ndarray, v: np.ndarray,
           n_rows: int) -> Shape:
    """The kernel shape of these arrays; ValueError if they do not fit together."""
    N, H, D = q.shape
    if N != n_rows or k.ndim != 5 or k.shape[4] != D or H % k.shape[3] or \
            k.shape != v.shape or k.dtype != v.dtype or k.dtype not in KV_TYPES or \
            not (k.flags.c_contiguous and v.flags.c_contiguous) or \
            k_new.shape != (N,) + k.shape[3:] or v_new.shape != k_new.shape:
        raise ValueError(f"q {q.shape}, new k {k_new.shape} and v {v_new.shape} do not fit "
                         f"{n_rows} rows of GQA attention over a cache {k.shape} {k.dtype}")
    return Shape(H, k.shape[3], D, k.shape[2], KV_TYPES[k.dtype])
