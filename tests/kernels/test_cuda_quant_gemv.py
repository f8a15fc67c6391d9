"""CUDA quantized GEMV vs gguf.quants.dequantize(W) @ x (simulator: tiny shapes; H200: real)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from gguf.quants import dequantize, quantize
from numba import cuda

from sparkinfer_cli.gguf.ggml_types import COMPUTE_TYPES, GGMLType, row_bytes
from sparkinfer_cli.kernels.cuda import quant_gemv as qg
from sparkinfer_cli.kernels.cuda.runtime.launch import to_device_bytes

# byte offsets of the fp16 scale fields in one block, overwritten with sane values
_SCALE_FIELDS = {
    GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,),
    GGMLType.IQ4_NL: (0,), GGMLType.IQ4_XS: (0,),
}
_QUANTIZABLE = {GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0,
                GGMLType.BF16}


def random_weights(ggml_type: GGMLType, n_rows: int, k: int, rng) -> np.ndarray:
    """Valid GGUF bytes (n_rows, row_bytes) with weights of RMS ≈ 0.03 like real checkpoints."""
    if ggml_type == GGMLType.F32:
        return (rng.standard_normal((n_rows, k)) * 0.03).astype(np.float32).view(np.uint8)
    if ggml_type == GGMLType.F16:
        return (rng.standard_normal((n_rows, k)) * 0.03).astype(np.float16).view(np.uint8)
    if ggml_type in _QUANTIZABLE:
        return quantize((rng.standard_normal((n_rows, k)) * 0.03).astype(np.float32), ggml_type)
    raw = rng.integers(0, 256, (n_rows, row_bytes(ggml_type, k)), dtype=np.uint8)
    block_bytes = {GGMLType.Q4_K: 144, GGMLType.Q5_K: 176, GGMLType.Q6_K: 210,
                   GGMLType.IQ4_NL: 18, GGMLType.IQ4_XS: 136}[ggml_type]
    blocks = raw.reshape(n_rows, -1, block_bytes)  # (n_rows, blocks, block_bytes)
    for off in _SCALE_FIELDS[ggml_type]:
        scales = rng.uniform(1e-4, 4e-4, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, off:off + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return raw


def upload_activations(x: np.ndarray, w: qg.DeviceQuantMatrix):
    """x (n_groups, n_cols, k) float32 → what the GEMV of w takes (q8 blocks or float32)."""
    x_dev = cuda.to_device(x)
    if w.takes_float_activations:
        return x_dev
    act = qg.QuantizedActivations(*x.shape)
    qg.quantize_activations(x_dev, act)
    return act


def dev_i32(a):
    return None if a is None else cuda.to_device(np.asarray(a, np.int32))


def run_gemv(w_bytes, ggml_type, k, x, slot_mat=None, slot_x=None, n_mats=1):
    """x: (n_groups, n_cols, k) float32 → y (n_slots, n_cols, n_rows) from the CUDA kernel."""
    n_rows = w_bytes.size // row_bytes(ggml_type, k) // n_mats
    w = qg.DeviceQuantMatrix(to_device_bytes(w_bytes), ggml_type, k, n_rows, n_mats)
    n_slots = 1 if slot_mat is None else len(slot_mat)
    y = cuda.device_array((n_slots, x.shape[1], n_rows), np.float32)
    qg.gemv(w, upload_activations(x, w), y, slot_mat=dev_i32(slot_mat), slot_x=dev_i32(slot_x))
    return y.copy_to_host()


def activations_seen_by_kernel(x: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    if ggml_type in qg.FLOAT_TYPES:
        return x
    q, d, _ = qg.quantize_q8_reference(x)
    return (q.reshape(*d.shape, 32) * d[..., None]).reshape(x.shape)


def check_close(y, w_bytes, ggml_type, k, x):
    """Tight check against the exact activations the kernel sees, loose against float32 x."""
    ref = qg.gemv_reference(w_bytes, ggml_type, k, activations_seen_by_kernel(x, ggml_type))
    w_abs = np.abs(dequantize(w_bytes.reshape(-1, row_bytes(ggml_type, k)), ggml_type))  # (n, k)
    scale = np.abs(x.astype(np.float64)) @ w_abs.T  # (n_cols, n_rows): Σ|w||x|, the error yardstick
    np.testing.assert_array_less(np.abs(y - ref), 2e-5 * scale + 1e-7)
    loose = np.abs(y - qg.gemv_reference(w_bytes, ggml_type, k, x))
    np.testing.assert_array_less(loose, 2e-2 * scale + 1e-6)


@pytest.mark.parametrize("ggml_type", sorted(COMPUTE_TYPES), ids=lambda t: GGMLType(t).name)
def test_gemv_matches_dequantized_reference(ggml_type):
    rng = np.random.default_rng(int(ggml_type))
    k, n_rows, n_cols = 256, 3, 2
    w_bytes = random_weights(GGMLType(ggml_type), n_rows, k, rng)
    x = rng.standard_normal((1, n_cols, k)).astype(np.float32)
    y = run_gemv(w_bytes, ggml_type, k, x)
    check_close(y[0], w_bytes, ggml_type, k, x[0])


def test_gemv_slots_pick_expert_matrices_and_activation_groups():
    rng = np.random.default_rng(7)
    k, n_rows, n_mats = 256, 3, 4
    ggml_type = GGMLType.Q4_K
    w_bytes = random_weights(ggml_type, n_mats * n_rows, k, rng)
    x = rng.standard_normal((2, 1, k)).astype(np.float32)
    slot_mat, slot_x = [3, 0, 2], [1, 0, 1]
    y = run_gemv(w_bytes, ggml_type, k, x, slot_mat, slot_x, n_mats)
    per_mat = w_bytes.reshape(n_mats, n_rows, -1)
    for s, (m, g) in enumerate(zip(slot_mat, slot_x)):
        check_close(y[s], per_mat[m], ggml_type, k, x[g])


@pytest.mark.parametrize("ggml_type, k", [(GGMLType.Q4_K, 256), (GGMLType.F32, 1024)],
                         ids=["rows", "split rows"])
@pytest.mark.slow
def test_gemv_loops_over_row_blocks_past_the_grid_limit(monkeypatch, ggml_type, k):
    # a grid.y of 2 stands in for CUDA's 65,535: each block takes row blocks y, y + 2, ...
    monkeypatch.setattr(qg, "MAX_GRID_Y", 2)
    rng = np.random.default_rng(16)
    n_rows, n_mats = 13, 2  # 4 row blocks of 4 rows a matrix (split rows: 13 of 1)
    w_bytes = random_weights(ggml_type, n_mats * n_rows, k, rng)
    x = rng.standard_normal((2, 1, k)).astype(np.float32)
    slot_mat, slot_x = [1, 0], [0, 1]
    y = run_gemv(w_bytes, ggml_type, k, x, slot_mat, slot_x, n_mats)
    per_mat = w_bytes.reshape(n_mats, n_rows, -1)
    for s, (m, g) in enumerate(zip(slot_mat, slot_x)):
        check_close(y[s], per_mat[m], ggml_type, k, x[g])


@pytest.mark.parametrize("ggml_type, k", [(GGMLType.F32, 1024), (GGMLType.Q8_0, 8192)],
                         ids=["F32", "Q8_0"])
@pytest.mark.slow
def test_gemv_splits_few_long_rows_over_the_blocks_warps(ggml_type, k):
    rng = np.random.default_rng(15)
    n_rows, n_cols = 3, 2
    assert qg.row_warps(ggml_type, k, n_rows) == qg.WARPS_PER_BLOCK  # the path under test
    w_bytes = random_weights(ggml_type, n_rows, k, rng)
    x = rng.standard_normal((1, n_cols, k)).astype(np.float32)
    y = run_gemv(w_bytes, ggml_type, k, x)
    check_close(y[0], w_bytes, ggml_type, k, x[0])


def test_quantize_activations_matches_reference():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 2, 64)).astype(np.float32)
    x[0, 1, 32:] = 0.0  # an all-zero block must give d = 0, q = 0
    act = qg.QuantizedActivations(*x.shape)
    qg.quantize_activations(cuda.to_device(x), act)
    q, d, s = qg.quantize_q8_reference(x)
    np.testing.assert_array_equal(act.xq.copy_to_host().reshape(x.shape), q)
    np.testing.assert_allclose(act.xd.copy_to_host(), d.reshape(-1), rtol=1e-6)
    np.testing.assert_allclose(act.xs.copy_to_host(), s.reshape(-1), rtol=1e-5, atol=1e-6)


def test_gemv_rejects_rows_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match="k % 256"):
        qg.DeviceQuantMatrix(to_device_bytes(np.zeros(288, np.uint8)), GGMLType.Q4_K, 128, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type, k, n_rows, n_mats, n_slots, n_cols", [
    (GGMLType.Q4_K, 2048, 512, 256, 8, 1),     # Qwen3.6 ffn_gate/up_exps, top-8
    (GGMLType.Q5_K, 512, 2048, 256, 8, 1),     # ffn_down_exps
    (GGMLType.Q8_0, 2048, 8192, 1, 1, 4),      # GDN attn_qkv, batch 4
    (GGMLType.Q6_K, 2048, 151936, 1, 1, 8),    # Qwen3 output, batch 8
    (GGMLType.IQ4_XS, 4096, 4096, 1, 1, 3),
    (GGMLType.BF16, 4096, 4096, 1, 1, 2),
    (GGMLType.F32, 2048, 257, 1, 1, 1),        # Qwen3.6 router + shared-expert gate
    (GGMLType.Q6_K, 2048, 248320, 1, 1, 1),    # Qwen3.6 output, batch 1: two rows a lane
    (GGMLType.Q8_0, 2048, 12352, 1, 1, 1),     # Qwen3.6 GDN input projection, batch 1
])
def test_gemv_real_shapes(ggml_type, k, n_rows, n_mats, n_slots, n_cols):
    rng = np.random.default_rng(12)
    w_bytes = random_weights(ggml_type, n_mats * n_rows, k, rng).reshape(n_mats, n_rows, -1)
    x = rng.standard_normal((1, n_cols, k)).astype(np.float32)
    slot_mat = rng.choice(n_mats, n_slots, replace=False)
    y = run_gemv(w_bytes, ggml_type, k, x, slot_mat, [0] * n_slots, n_mats)
    rows = np.sort(rng.choice(n_rows, min(n_rows, 512), replace=False))  # reference on a subset
    for s, m in enumerate(slot_mat):
        check_close(y[s][:, rows], w_bytes[m][rows], ggml_type, k, x[0])


def swiglu_reference(gate_bytes, up_bytes, ggml_type, k, x_slot):
    """silu(gate·x) ⊙ (up·x) in float64 for x (n_cols, k) as the kernel sees it."""
    xk = activations_seen_by_kernel(x_slot, ggml_type)
    g = qg.gemv_reference(gate_bytes, ggml_type, k, xk)
    return g / (1 + np.exp(-g)) * qg.gemv_reference(up_bytes, ggml_type, k, xk)


def check_expert_slots(ggml_type, k, n_rows, slot_mat, slot_x, swiglu, rng):
    """The per-slot GEMV (fused SwiGLU when swiglu) over random expert matrices and 2 activation
    groups, each slot checked against numpy."""
    n_mats = max(slot_mat) + 1
    gate_bytes, up_bytes = (random_weights(ggml_type, n_mats * n_rows, k, rng) for _ in range(2))
    x = rng.standard_normal((2, 1, k)).astype(np.float32)
    gate, up = (qg.DeviceQuantMatrix(to_device_bytes(b), ggml_type, k, n_rows, n_mats)
                for b in (gate_bytes, up_bytes))
    y = cuda.device_array((len(slot_mat), 1, n_rows), np.float32)  # (slots, 1, rows)
    qg.gemv(gate, upload_activations(x, gate), y, slot_mat=dev_i32(slot_mat),
            slot_x=dev_i32(slot_x), up=up if swiglu else None)
    y = y.copy_to_host()
    per_mat = [b.reshape(n_mats, n_rows, -1) for b in (gate_bytes, up_bytes)]
    for s, (m, g) in enumerate(zip(slot_mat, slot_x)):
        if swiglu:
            ref = swiglu_reference(per_mat[0][m], per_mat[1][m], ggml_type, k, x[g])
            np.testing.assert_allclose(y[s], ref, rtol=1e-4, atol=1e-6)
        else:
            check_close(y[s], per_mat[0][m], ggml_type, k, x[g])


def test_fused_swiglu_gemv_over_expert_slots():
    check_expert_slots(GGMLType.Q4_K, 256, 3, [2, 0, 2], [0, 0, 1], True,
                       np.random.default_rng(13))


@pytest.mark.parametrize("ggml_type, k, n_rows, swiglu", [
    (GGMLType.Q4_K, 256, 13, False),  # 8 rows a block: the second block's last 3 rows are past
    (GGMLType.Q8_0, 64, 37, False),  # 2 lanes a row: 32 rows a warp
    (GGMLType.Q4_K, 256, 13, True),
], ids=["Q4_K", "Q8_0 short rows", "Q4_K SwiGLU"])
def test_gemv_with_two_rows_a_lane(monkeypatch, ggml_type, k, n_rows, swiglu):
    monkeypatch.setattr(qg, "MULTI_ROW_MIN_ROWS", 1)  # the path big matrices take
    assert qg.rows_per_lane(1, n_rows, 1, 1) == 2
    check_expert_slots(ggml_type, k, n_rows, [1, 0, 1], [0, 1, 1], swiglu,
                       np.random.default_rng(17))


@pytest.mark.parametrize("ggml_type, k, lanes", [
    (GGMLType.Q4_K, 1024, 4),  # 16 units: 8 → 4 lanes, 4 units each
    (GGMLType.Q6_K, 768, 4),  # 12 units: 16 lanes → 4 (3 units each: they split evenly)
    (GGMLType.Q8_0, 512, 4),  # 16 units
], ids=["Q4_K", "Q6_K uneven", "Q8_0"])
@pytest.mark.slow
def test_gemv_with_rows_narrowed_to_fewer_lanes(monkeypatch, ggml_type, k, lanes):
    # a GEMV past the lane budget (the LM head, many expert slots): fewer lanes a row, each
    # looping over several units; 13 rows over 3 slots leave a block's last rows past the end
    monkeypatch.setattr(qg, "LANE_BUDGET", 1)
    assert qg.lanes_per_row(ggml_type, k, 13 * 3) == lanes
    check_expert_slots(ggml_type, k, 13, [1, 0, 1], [0, 1, 1], False, np.random.default_rng(19))


@pytest.mark.slow  # a minute or more in the simulator on 2 cores
@pytest.mark.parametrize("ggml_type, k, budget", [
    (GGMLType.Q8_0, 1024, ("LANE_BUDGET", 8 * 32)),  # 32 units: 32 lanes alone, 8 beside 2 more
    (GGMLType.F32, 1024, ("SPLIT_ROWS_BELOW", 16)),  # 4 warps a row alone, 1 beside 2 more
], ids=["narrowed lanes", "warps a row"])
def test_gemv_row_is_bit_identical_alone_and_among_slots(monkeypatch, ggml_type, k, budget):
    """A slot's output may not depend on the slots beside it (greedy answers must not change with
    the batch): the same expert rows × activations, alone and as one of 3 slots whose rows × slots
    pass the budget (the launch narrows each row's lanes, or stops sharing it over warps)."""
    monkeypatch.setattr(qg, *budget)
    rng = np.random.default_rng(23)
    n_rows, n_mats = 8, 2
    w_bytes = random_weights(ggml_type, n_rows * n_mats, k, rng)
    x = rng.standard_normal((2, 2, k)).astype(np.float32)
    slot_mat, slot_x = [1, 0, 1], [0, 1, 1]
    assert qg.lanes_per_row(ggml_type, k, n_rows) > qg.lanes_per_row(ggml_type, k, 3 * n_rows) \
        or qg.row_warps(ggml_type, k, n_rows) > qg.row_warps(ggml_type, k, 3 * n_rows)
    together = run_gemv(w_bytes, ggml_type, k, x, slot_mat, slot_x, n_mats)
    for s, (m, g) in enumerate(zip(slot_mat, slot_x)):
        alone = run_gemv(w_bytes, ggml_type, k, x[g:g + 1], [m], [0], n_mats)
        np.testing.assert_array_equal(together[s], alone[0])
        check_close(alone[0], w_bytes.reshape(n_mats, n_rows, -1)[m], ggml_type, k, x[g])


def test_only_fixed_order_gemvs_keep_a_sum_per_virtual_lane(monkeypatch):
    """Past the lane budget a fixed-order GEMV keeps the lanes one slot would get (narrowed lanes
    each standing for several); a launch-shaped one (passes whose dense linears run on tensor
    cores) narrows the lanes and keeps one sum a lane."""
    monkeypatch.setattr(qg, "LANE_BUDGET", 8 * 32)
    w = SimpleNamespace(ggml_type=GGMLType.Q8_0, k=1024, n_rows=8)
    alone = qg.lanes_per_row(w.ggml_type, w.k, w.n_rows)
    narrowed = qg.lanes_per_row(w.ggml_type, w.k, 3 * w.n_rows)
    assert narrowed < alone
    assert qg.reduction_layout(w, 3) == (narrowed, alone // narrowed, 1)
    assert qg.reduction_layout(w, 3, fixed_order=False) == (narrowed, 1, 1)


def test_lanes_per_row_narrows_only_gemvs_past_the_budget():
    # Qwen3-30B-A3B decode shapes: the attention output projection keeps a warp a row, the fused
    # q/k/v and the experts' gate+up halve it, the LM head goes to 4 lanes of 8 units
    assert qg.lanes_per_row(GGMLType.Q4_K, 4096, 2048) == 32
    assert qg.lanes_per_row(GGMLType.Q4_K, 2048, 5120) == 16
    assert qg.lanes_per_row(GGMLType.Q4_K, 2048, 8 * 768) == 16
    assert qg.lanes_per_row(GGMLType.Q6_K, 2048, 151936) == 4
    assert qg.lanes_per_row(GGMLType.Q4_K, 768, 8 * 2048) == 4  # 12 units: even over 4 lanes


def test_stacked_gemv_splits_rows_over_outputs_and_adds_bias():
    # three linears stacked row-wise (2, 3, 1 rows), two activation columns, one launch
    rng = np.random.default_rng(14)
    k, parts, n_cols = 64, (2, 3, 1), 2
    ggml_type = GGMLType.Q8_0
    w_bytes = random_weights(ggml_type, sum(parts), k, rng)
    bias = rng.standard_normal(sum(parts)).astype(np.float32)
    x = rng.standard_normal((1, n_cols, k)).astype(np.float32)
    w = qg.DeviceQuantMatrix(to_device_bytes(w_bytes), ggml_type, k, sum(parts))
    act = qg.QuantizedActivations(*x.shape)
    qg.quantize_activations(cuda.to_device(x), act)
    ys = [cuda.device_array((1, n_cols, n), np.float32) for n in parts]
    qg.gemv(w, act, ys, bias=cuda.to_device(bias))
    ref = qg.gemv_reference(w_bytes, ggml_type, k, activations_seen_by_kernel(x[0], ggml_type))
    got = np.concatenate([y.copy_to_host()[0] for y in ys], axis=1)  # (n_cols, Σ parts)
    np.testing.assert_allclose(got, ref + bias, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="hold 5 rows"):
        qg.gemv(w, act, ys[:2])
