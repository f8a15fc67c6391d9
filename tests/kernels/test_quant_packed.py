"""Packed decode weights and their AVX2 matvec: the packed blocks decoded by this file's own numpy
reading of the documented layout equal gguf.quants.dequantize bit for bit, and the kernel (alone
and fused over several weights, on one or two threads, for one or several x rows) matches a
float64 oracle built from gguf.quants.dequantize(W) and x quantized by this file's own numpy code.
Rows of x multiplied in one call equal each row multiplied alone, bit for bit, with AVX2's integer
dot and with VNNI's."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from quant_samples import N_ROWS, NE0, random_weight

from sparkinfer_cli.gguf.ggml_types import GGMLType
from sparkinfer_cli.kernels.cpu import llvm_jit, packed_matvec, quant
from sparkinfer_cli.kernels.cpu.llvm_jit import has_avx2, has_vnni
from sparkinfer_cli.kernels.cpu.packed_matvec import PackedMatvec
from sparkinfer_cli.kernels.cpu.quant_packed import (
    MAX_ROWS,
    PACKED_TYPES,
    RECORD_ELEMENTS,
    RecordLayout,
    can_pack,
    pack,
    x_order,
)

TYPES = sorted(GGMLType(t) for t in PACKED_TYPES)
needs_avx2 = pytest.mark.skipif(not has_avx2(), reason="the packed kernel is AVX2 code")


def dequantize_packed(records: np.ndarray, layout: RecordLayout) -> np.ndarray:
    """float32 (rows, ne0) from packed records, following the layout in quant_packed's
    docstring: each row's pairs of records, then its last record alone if it has an odd number."""
    rows = records.shape[0]
    if layout.is_q8:  # two GGUF blocks
        b = records.reshape(-1, 34)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)  # (2n, 1)
        return (b[:, 2:].view(np.int8).astype(np.float32) * d).reshape(rows, -1)
    n_rec = records.shape[1] // layout.size
    paired = n_rec // 2 * 2 * layout.size  # bytes of a row's pairs
    parts = []
    if paired:
        order = x_order(2 * RECORD_ELEMENTS)[0]  # element of the pair that vector byte k holds
        values = _decode(records[:, :paired].reshape(-1, 2 * layout.size), layout, 4)
        natural = np.empty_like(values)
        natural[:, order] = values
        parts.append(natural.reshape(rows, -1))
    if paired < records.shape[1]:
        parts.append(_decode(records[:, paired:], layout, 2).reshape(rows, -1))
    return np.concatenate(parts, axis=1)


def _decode(r: np.ndarray, layout: RecordLayout, n_vec: int) -> np.ndarray:
    """float32 (n, 32·n_vec): records of n_vec 32-quant vectors (2: a lone record, blocks A, B
    in element order; 4: a pair, in the kernel's vector order, scales in lane order)."""
    n_sc, sb, lb = layout.n_scales, layout.scale_bytes, layout.low_bits
    sdt = "<f2" if layout.scale == "half" else "<f4"
    grow = n_vec // 2  # a pair's fields are twice a record's
    d = r[:, :n_vec * sb * n_sc].copy().view(sdt).astype(np.float32)  # (n, n_vec·n_sc)
    nib = r[:, grow * layout.nibble_offset:].reshape(-1, grow, 32)
    q = np.stack([nib & 15, nib >> 4], axis=2).reshape(-1, n_vec, 32).astype(np.int64)
    if lb:
        planes = r[:, grow * layout.low_offset:grow * layout.nibble_offset].copy().view(
            "<u4" if lb == 1 else "<u8").astype(np.uint64)  # (n, n_vec)
        e = np.arange(32)
        k, b = e // 4, e % 4
        pos = (8 * b + k if lb == 1 else 32 * (k & 1) + 8 * b + 2 * (k >> 1)).astype(np.uint64)
        low = (planes[:, :, None] >> pos) & np.uint64(2 ** lb - 1)  # (n, n_vec, 32)
        q = (q << lb) | low.astype(np.int64)
    if n_vec == 2:  # element e of block j: scale j·n_sc + e // (32 / n_sc), block-major
        scale = np.repeat(d.reshape(-1, 2, n_sc), 32 // n_sc, axis=2)  # (n, 2, 32)
        block = np.repeat(np.arange(2)[:, None], 32, axis=1)  # (2, 32)
    else:  # byte k of a vector is in lane k // 4; lane g: block g % 4 (Q6_K: half g // 4)
        lane = np.arange(32) // 4
        scale = d[:, lane % 4 + 4 * (lane // 4) * (n_sc - 1)][:, None, :]  # (n, 1, 32)
        block = np.repeat((lane % 4)[None, :], 4, axis=0)  # (4, 32)
    w = (q - layout.bias).astype(np.float32) * scale
    if layout.has_m:
        m = r[:, grow * layout.m_offset:grow * layout.m_offset + n_vec * sb].copy().view(
            sdt).astype(np.float32)  # (n, blocks)
        w = w + m[:, block]
    return w.reshape(len(r), -1)


def q8_reference(x: np.ndarray) -> np.ndarray:
    """x float32 (T, ne0) → float64 dequantized int8 activations, d = max|x|/127 per 32."""
    blocks = x.reshape(x.shape[0], -1, 32)  # (T, n_blocks, 32)
    d = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127)  # float32, as the kernel
    q = np.rint(blocks / np.where(d > 0, d, 1))
    return (q.astype(np.float64) * d).reshape(x.shape)


def oracle(raws: list[tuple[np.ndarray, GGMLType]], x: np.ndarray) -> tuple[np.ndarray, ...]:
    """(want, scale): float64 concat_i(dequantize(W_i) @ q8(x)) and Σ|w·x| per output row."""
    w64 = np.concatenate([gguf.quants.dequantize(r, gguf.GGMLQuantizationType(t))
                          for r, t in raws]).astype(np.float64)  # (Σ rows, ne0)
    xq = q8_reference(x)
    return xq @ w64.T, np.abs(xq) @ np.abs(w64).T


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_pack_is_lossless(t: GGMLType, rng: np.random.Generator) -> None:
    raw = random_weight(t, rng)
    w = pack(raw, t, NE0)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t))
    got = dequantize_packed(w.records, w.layout)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert w.nbytes <= raw.nbytes * 4 // 3  # compact: at most a third above ggml's own bytes


@needs_avx2
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_matvec_matches_float64_oracle(t: GGMLType, rng: np.random.Generator) -> None:
    raw = random_weight(t, rng)
    matvec = PackedMatvec([pack(raw, t, NE0)], [None])
    for x in (rng.standard_normal((1, NE0)).astype(np.float32),
              np.where(np.arange(NE0) < 64, 0, rng.standard_normal((1, NE0))).astype(np.float32)):
        got = matvec(x)  # second x: two all-zero activation blocks (d = 0)
        want, scale = oracle([(raw, t)], x)
        assert got.shape == (1, N_ROWS) and got.dtype == np.float32
        assert np.all(np.abs(got - want) <= 1e-5 * scale), np.max(np.abs(got - want) / scale)


@needs_avx2
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_matvec_of_mixed_types_with_bias(threads: int, rng: np.random.Generator,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k/v-like fusion: three weights of different types, two with biases, split over threads
    at row boundaries that fall inside a weight; x rows in two hand-offs of two kernel passes
    each, the last pass of each short."""
    monkeypatch.setattr(packed_matvec, "_MIN_WORK_PER_PART", 1 if threads == 2 else 1 << 40)
    monkeypatch.setattr(packed_matvec, "GROUP_ROWS", MAX_ROWS + 2)
    monkeypatch.setattr(quant, "_num_threads", lambda: threads)
    types = [GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q6_K]
    raws = [(random_weight(t, rng), t) for t in types]
    biases = [rng.standard_normal(N_ROWS).astype(np.float32), None,
              rng.standard_normal(N_ROWS).astype(np.float32)]
    matvec = PackedMatvec([pack(r, t, NE0) for r, t in raws], biases)
    n = 2 * MAX_ROWS + 3
    x = rng.standard_normal((n, NE0)).astype(np.float32)
    got = matvec(x)
    want, scale = oracle(raws, x)
    want += np.concatenate([b if b is not None else np.zeros(N_ROWS) for b in biases])
    assert got.shape == (n, 3 * N_ROWS)
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-6), np.max(np.abs(got - want) / scale)
    parts = matvec.split(got)
    assert [p.shape for p in parts] == [(n, N_ROWS)] * 3
    np.testing.assert_array_equal(parts[2], got[:, 2 * N_ROWS:])


@needs_avx2
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_rows_of_one_call_equal_each_row_alone(t: GGMLType, rng: np.random.Generator) -> None:
    """A decode step's tokens in one call (up to MAX_ROWS per pass over the weights, then the next
    MAX_ROWS): each row of the result is that row's call alone, bit for bit."""
    raw = random_weight(t, rng)
    matvec = PackedMatvec([pack(raw, t, NE0)], [None])
    x = (rng.standard_normal((MAX_ROWS + 3, NE0)) * rng.uniform(0.01, 10, (MAX_ROWS + 3, 1)))
    x[1, 64:128] = 0  # one row with zero activation blocks (d = 0) among nonzero ones
    x = x.astype(np.float32)
    got = matvec(x)
    want, scale = oracle([(raw, t)], x)
    assert got.shape == (MAX_ROWS + 3, N_ROWS)
    assert np.all(np.abs(got - want) <= 1e-5 * scale), np.max(np.abs(got - want) / scale)
    alone = np.concatenate([matvec(x[i:i + 1]) for i in range(len(x))])
    np.testing.assert_array_equal(got, alone)
    np.testing.assert_array_equal(matvec(x[2:5]), got[2:5])


@needs_avx2
@pytest.mark.parametrize("ne0", [64, 576])
@pytest.mark.parametrize("t", [GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q8_0],
                         ids=lambda t: t.name)
def test_rows_of_an_odd_number_of_records(t: GGMLType, ne0: int,
                                          rng: np.random.Generator) -> None:
    """Rows of 1 and 9 records (the kernel takes records in pairs, the last one alone): packed
    losslessly, the oracle, and each row of a call equal to that row alone, with and without
    offsets."""
    raw = random_weight(t, rng, ne0)
    w = pack(raw, t, ne0)
    want_w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t))
    np.testing.assert_array_equal(dequantize_packed(w.records, w.layout), want_w)
    matvec = PackedMatvec([w], [None])
    x = (rng.standard_normal((MAX_ROWS + 2, ne0)) * rng.uniform(0.01, 10, (MAX_ROWS + 2, 1)))
    x = x.astype(np.float32)
    got = matvec(x)
    want, scale = oracle([(raw, t)], x)
    assert np.all(np.abs(got - want) <= 1e-5 * scale), np.max(np.abs(got - want) / scale)
    np.testing.assert_array_equal(matvec(x[3:4]), got[3:4])


@needs_avx2
@pytest.mark.skipif(not has_vnni(), reason="this CPU has no VNNI dot to compare with")
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_vnni_and_avx2_dots_agree(t: GGMLType, rng: np.random.Generator,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    w = pack(random_weight(t, rng), t, NE0)
    x = rng.standard_normal((5, NE0)).astype(np.float32)
    with_vnni = PackedMatvec([w], [None])(x)
    monkeypatch.setattr(llvm_jit, "has_vnni", lambda: False)
    np.testing.assert_array_equal(PackedMatvec([w], [None])(x), with_vnni)


def test_rejects_bad_input(rng: np.random.Generator) -> None:
    raw = random_weight(GGMLType.Q8_0, rng)
    with pytest.raises(ValueError, match="ggml types"):
        pack(raw, int(GGMLType.IQ4_NL), NE0)
    q5 = random_weight(GGMLType.Q5_0, rng)
    assert not can_pack(GGMLType.Q8_0, 96) and can_pack(GGMLType.Q8_0, 128)
    with pytest.raises(ValueError, match="multiple of 64"):
        pack(q5.reshape(-1, 22 * 3), GGMLType.Q5_0, 96)
    with pytest.raises(ValueError, match="raw must be"):
        pack(raw[:, :-1], GGMLType.Q8_0, NE0)
    w = pack(raw, GGMLType.Q8_0, NE0)
    with pytest.raises(ValueError, match="one ne0"):
        PackedMatvec([w, pack(raw.reshape(-1, 34 * 12), GGMLType.Q8_0, 384)], [None, None])
    if has_avx2():
        with pytest.raises(ValueError, match="x must be"):
            PackedMatvec([w], [None])(np.zeros((1, NE0 - 32), np.float32))
        with pytest.raises(ValueError, match="x must be"):
            PackedMatvec([w], [None])(np.zeros(NE0, np.float32))
