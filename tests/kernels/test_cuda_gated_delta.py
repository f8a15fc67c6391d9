"""CUDA Gated DeltaNet conv step and recurrent step vs float64 numpy."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from numba import cuda

from sparkinfer_cli.kernels.cuda import gated_delta as gd
from sparkinfer_cli.kernels.cuda import gated_delta_chunked as gdc
from sparkinfer_cli.kernels.delta_rule_reference import fused_step


def test_conv_silu_step_shifts_state():
    rng = np.random.default_rng(8)
    mixed = rng.standard_normal((2, 6)).astype(np.float32)
    conv_w = rng.standard_normal((6, 4)).astype(np.float32)
    state = rng.standard_normal((3, 6, 3)).astype(np.float32)  # (slots, conv_dim, K-1)
    slots = np.array([2, 0], np.int32)
    dev_state, out = cuda.to_device(state), cuda.device_array((2, 6), np.float32)
    gd.conv_silu_step(cuda.to_device(mixed), cuda.to_device(conv_w), dev_state,
                      cuda.to_device(slots), out)
    window = np.concatenate([state[slots], mixed[:, :, None]], axis=2).astype(np.float64)
    pre = (window * conv_w).sum(axis=2)
    np.testing.assert_allclose(out.copy_to_host(), pre / (1 + np.exp(-pre)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(dev_state.copy_to_host()[slots], window[:, :, 1:])
    np.testing.assert_array_equal(dev_state.copy_to_host()[1], state[1])


@pytest.mark.parametrize("n_seqs, n_k, n_v, dk, dv", [
    (1, 1, 2, 32, 8),
    pytest.param(3, 16, 32, 128, 128, marks=pytest.mark.gpu),  # Qwen3.6 GDN
])
@pytest.mark.slow
def test_delta_rule_step_matches_reference_for_both_head_maps(n_seqs, n_k, n_v, dk, dv):
    rng = np.random.default_rng(9)
    u = rng.standard_normal((n_seqs, 2 * n_k * dk + n_v * dv)).astype(np.float32)
    a, b = (rng.standard_normal((n_seqs, n_v)).astype(np.float32) for _ in range(2))
    ssm_a = -rng.uniform(0.5, 2, n_v).astype(np.float32)
    dt_bias = rng.standard_normal(n_v).astype(np.float32)
    state = rng.standard_normal((n_seqs, n_v, dv, dk)).astype(np.float32) * 0.1
    for head_map_mod in (True, False):
        dev_state, out = cuda.to_device(state), cuda.device_array((n_seqs, n_v, dv), np.float32)
        gd.delta_rule_step(cuda.to_device(u), cuda.to_device(a), cuda.to_device(b),
                           cuda.to_device(ssm_a), cuda.to_device(dt_bias), dev_state,
                           cuda.to_device(np.arange(n_seqs, dtype=np.int32)), out, n_k_heads=n_k,
                           head_map_mod=head_map_mod, eps=1e-6)
        ref_out, ref_state = fused_step(u, a, b, ssm_a, dt_bias, state, n_k,
                                                          head_map_mod, 1e-6)
        np.testing.assert_allclose(out.copy_to_host(), ref_out, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dev_state.copy_to_host(), ref_state, rtol=1e-4, atol=1e-5)


def _conv_seq_reference(mixed, conv_w, state, slots, lo, n):
    """Each sequence's rows through the causal conv one row at a time, float64."""
    out, new_state = np.zeros(mixed.shape), state.astype(np.float64).copy()
    for s in range(len(n)):
        hist = new_state[slots[s]]  # (conv_dim, K − 1)
        for r in range(lo[s], lo[s] + n[s]):
            window = np.concatenate([hist, mixed[r][:, None]], axis=1)  # (conv_dim, K)
            pre = (window * conv_w).sum(axis=1)
            out[r], hist = pre / (1 + np.exp(-pre)), window[:, 1:]
        new_state[slots[s]] = hist
    return out, new_state


@pytest.mark.slow
def test_conv_silu_seq_blocks_of_several_rows_split_sequences():
    """512 rows → 4 rows a block: sequence starts and their first K − 1 rows fall across block
    edges; lengths 1 and 2 (< K − 1) keep part of the old state; rows nobody owns stay as they
    were; a sequence entry after an empty one still runs."""
    rng = np.random.default_rng(6)
    mixed = rng.standard_normal((512, 6)).astype(np.float32)
    conv_w = rng.standard_normal((6, 4)).astype(np.float32)
    state = rng.standard_normal((6, 6, 3)).astype(np.float32)  # (slots, conv_dim, K − 1)
    entries = np.zeros((3, 512), np.int32)  # slots, lo, n of 512 sequence entries (as padded)
    entries[:, :5] = [[4, 0, 2, 1, 3], [1, 3, 14, 0, 15], [2, 11, 1, 0, 6]]
    slots, lo, n = entries
    dev_state = cuda.to_device(state)
    out = cuda.to_device(np.full(mixed.shape, 7, np.float32))
    gd.conv_silu_seq(cuda.to_device(mixed), cuda.to_device(conv_w), dev_state,
                     *(cuda.to_device(x) for x in (slots, lo, n)), out)
    ref_out, ref_state = _conv_seq_reference(mixed, conv_w, state, slots, lo, n)
    owned = np.zeros(512, bool)
    owned[1:21] = True
    got = out.copy_to_host()
    np.testing.assert_allclose(got[owned], ref_out[owned], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[~owned], 7)
    np.testing.assert_allclose(dev_state.copy_to_host(), ref_state, rtol=1e-6)


def _delta_inputs(rng, rows: int, n_k: int, n_v: int, dk: int, dv: int, slots: int):
    u = rng.standard_normal((rows, 2 * n_k * dk + n_v * dv)).astype(np.float32)
    a, b = (rng.standard_normal((rows, n_v)).astype(np.float32) for _ in range(2))
    a[::5] += 25  # some rows take softplus's t > 20 branch
    ssm_a = -rng.uniform(0.05, 0.5, n_v).astype(np.float32)  # slow decay: long memory
    dt_bias = rng.standard_normal(n_v).astype(np.float32)
    state = (rng.standard_normal((slots, n_v, dv, dk)) * 0.1).astype(np.float32)
    return u, a, b, ssm_a, dt_bias, state


def _delta_seq_reference(u, a, b, ssm_a, dt_bias, state, slots, lo, n, n_k, head_map_mod):
    """Sequence s's rows lo[s] .. + n[s] through the reference (fused_step) one token at a time."""
    out = np.zeros((u.shape[0], state.shape[1], state.shape[2]))  # (rows, H_v, dv)
    new_state = state.astype(np.float64).copy()
    for s in range(len(n)):
        for r in range(lo[s], lo[s] + n[s]):
            o, st = fused_step(u[r:r + 1], a[r:r + 1], b[r:r + 1], ssm_a,
                                                 dt_bias, new_state[slots[s]][None], n_k,
                                                 head_map_mod, 1e-6)
            out[r], new_state[slots[s]] = o[0], st[0]
    return out, new_state


def _run_delta_seq(u, a, b, ssm_a, dt_bias, state, slots, lo, n, n_k, head_map_mod,
                   prepare=False, chunked=False):
    dev_state = cuda.to_device(state)
    n_rows, n_v, dv, dk = u.shape[0], *state.shape[1:]
    out = cuda.to_device(np.full((n_rows, n_v, dv), 7, np.float32))
    lists = np.empty((2, n_rows), np.int32)
    gdc.chunk_list(np.asarray(lo), np.asarray(n), lists[0], lists[1])
    chunks = gdc.ChunkedPass(cuda.device_array((n_rows, n_v, gdc.scratch_cols(dk, dv)),
                                               np.float32), *(cuda.to_device(x) for x in lists))
    gd.delta_rule_seq(*(cuda.to_device(x) for x in (u, a, b, ssm_a, dt_bias)), dev_state,
                      *(cuda.to_device(np.asarray(x, np.int32)) for x in (slots, lo, n)), out,
                      n_k_heads=n_k, head_map_mod=head_map_mod, eps=1e-6, prepare=prepare,
                      chunks=chunks if chunked else None)
    return out.copy_to_host(), dev_state.copy_to_host()


@pytest.mark.parametrize("head_map_mod, prepare", [(True, False), (False, False), (True, True)])
@pytest.mark.slow
def test_delta_rule_seq_runs_sequences_from_their_rows_and_slots(head_map_mod, prepare):
    """Odd and even lengths (both prefetch buffers end a sequence), a length-1 sequence, an empty
    entry between sequences, columns past dv (dv = 6: 8 lane groups, 2 idle) and an untouched
    slot; rows no sequence owns keep their old output."""
    rng = np.random.default_rng(3)
    n_k, n_v, dk, dv = 1, 2, 32, 6
    u, a, b, ssm_a, dt_bias, state = _delta_inputs(rng, 13, n_k, n_v, dk, dv, slots=4)
    slots, lo, n = [2, 0, 3, 1], [1, 6, 0, 12], [5, 6, 0, 1]  # row 0 belongs to nobody
    out, new_state = _run_delta_seq(u, a, b, ssm_a, dt_bias, state, slots, lo, n, n_k,
                                    head_map_mod, prepare)
    ref_out, ref_state = _delta_seq_reference(u, a, b, ssm_a, dt_bias, state, slots, lo, n, n_k,
                                              head_map_mod)
    np.testing.assert_allclose(out[1:], ref_out[1:], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(out[0], 7)
    np.testing.assert_allclose(new_state, ref_state, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(new_state[3], state[3])


@pytest.mark.parametrize("prepare", [False, True])
@pytest.mark.slow
def test_delta_rule_seq_long_sequence_and_more_entries_than_grid_rows(prepare):
    """A 30-token sequence keeps its state in registers throughout (dk = 64: two float4s a
    lane; also with its q/k norms and gates prepared first); with 66 sequence entries (model
    padding) grid row 1 also runs entry 65."""
    rng = np.random.default_rng(4)
    n_k, n_v, dk, dv = 1, 1, 64, 4
    u, a, b, ssm_a, dt_bias, state = _delta_inputs(rng, 66, n_k, n_v, dk, dv, slots=3)
    slots, lo, n = np.zeros((3, 66), np.int32)
    slots[0], slots[65], lo[65], n[0], n[65] = 1, 2, 30, 30, 1
    out, new_state = _run_delta_seq(u, a, b, ssm_a, dt_bias, state, slots, lo, n, n_k, False,
                                    prepare)
    ref_out, ref_state = _delta_seq_reference(u, a, b, ssm_a, dt_bias, state, slots, lo, n, n_k,
                                              False)
    np.testing.assert_allclose(out[:31], ref_out[:31], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new_state, ref_state, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths, prepare, chunked", [
    ([300, 1, 77], True, False), ([300, 1, 77], False, False), ([1] * 64, False, False),
    ([300, 1, 77], True, True),  # chunked: chunks of many lengths, partial last ones
    ([128] * 16, True, True),  # chunked: the serve burst's pass
])
def test_delta_rule_seq_qwen36_shape(lengths, prepare, chunked):
    """Qwen3.6 GDN heads (16 k / 32 v, dk = dv = 128): prefill batches and a decode batch."""
    rng = np.random.default_rng(5)
    n_k, n_v, dk, dv = 16, 32, 128, 128
    S = len(lengths)
    lo = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int32)
    u, a, b, ssm_a, dt_bias, state = _delta_inputs(rng, sum(lengths), n_k, n_v, dk, dv, S + 1)
    slots = rng.permutation(S + 1)[:S].astype(np.int32)
    out, new_state = _run_delta_seq(u, a, b, ssm_a, dt_bias, state, slots, lo, lengths, n_k,
                                    True, prepare, chunked)
    ref_out, ref_state = _delta_seq_reference(u, a, b, ssm_a, dt_bias, state, slots, lo, lengths,
                                              n_k, True)
    close = assert_f16_close if chunked else functools.partial(np.testing.assert_allclose,
                                                              rtol=1e-3, atol=1e-4)
    close(out, ref_out)
    close(new_state, ref_state)


def assert_f16_close(got: np.ndarray, ref: np.ndarray) -> None:
    """Within what f16 operands (2⁻¹¹ a rounding) with float32 sums allow (the chunked kernels):
    relative RMS error ≤ 2e-3, as the public kernels' bf16 tests bound it, and no element off by
    more than 1 % of the largest. A wrong index, mask or decay is off by far more."""
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    worst = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= 2e-3 and worst <= 1e-2, f"relative RMS error {err:.2e}, worst {worst:.2e}"


# a check's states after its rows: sequence 1 (rows 3 .. 6) keeps its state after rows 4 and 5
# in slots 1 and 2; sequence 0's rows keep none
SNAP_SLOTS, SNAP_LO, SNAP_N = [4, 0], [0, 3], [3, 4]
SNAP_ROWS = np.array([-1, -1, -1, -1, 1, 2, -1], np.int32)


@pytest.mark.slow
def test_conv_silu_seq_keeps_the_state_after_the_rows_a_check_asks_for():
    rng = np.random.default_rng(8)
    mixed = rng.standard_normal((7, 6)).astype(np.float32)
    conv_w = rng.standard_normal((6, 4)).astype(np.float32)
    state = rng.standard_normal((6, 6, 3)).astype(np.float32)  # (slots, conv_dim, K − 1)
    dev_state, out = cuda.to_device(state), cuda.device_array(mixed.shape, np.float32)
    ints = (np.asarray(x, np.int32) for x in (SNAP_SLOTS, SNAP_LO, SNAP_N))
    gd.conv_silu_seq(cuda.to_device(mixed), cuda.to_device(conv_w), dev_state,
                     *(cuda.to_device(x) for x in ints), out,
                     row_state_slots=cuda.to_device(SNAP_ROWS))
    got = dev_state.copy_to_host()
    _, whole = _conv_seq_reference(mixed, conv_w, state, SNAP_SLOTS, SNAP_LO, SNAP_N)
    np.testing.assert_allclose(got[[0, 4]], whole[[0, 4]], rtol=1e-6)
    for slot, rows in ((1, 2), (2, 3)):  # the state after sequence 1's first `rows` rows
        _, part = _conv_seq_reference(mixed, conv_w, state, SNAP_SLOTS, SNAP_LO, [3, rows])
        np.testing.assert_allclose(got[slot], part[0], rtol=1e-6)
    np.testing.assert_array_equal(got[[3, 5]], state[[3, 5]])


@pytest.mark.slow
def test_delta_rule_seq_keeps_the_state_after_the_rows_a_check_asks_for():
    """dv = 6: the columns past it (idle lanes) must not write a kept state either."""
    rng = np.random.default_rng(9)
    n_k, n_v, dk, dv = 1, 2, 32, 6
    u, a, b, ssm_a, dt_bias, state = _delta_inputs(rng, 7, n_k, n_v, dk, dv, slots=6)
    dev_state = cuda.to_device(state)
    out = cuda.device_array((7, n_v, dv), np.float32)
    gd.delta_rule_seq(*(cuda.to_device(x) for x in (u, a, b, ssm_a, dt_bias)), dev_state,
                      *(cuda.to_device(np.asarray(x, np.int32))
                        for x in (SNAP_SLOTS, SNAP_LO, SNAP_N)), out,
                      n_k_heads=n_k, head_map_mod=True, eps=1e-6,
                      row_state_slots=cuda.to_device(SNAP_ROWS))
    got = dev_state.copy_to_host()
    ref_out, whole = _delta_seq_reference(u, a, b, ssm_a, dt_bias, state, SNAP_SLOTS, SNAP_LO,
                                          SNAP_N, n_k, True)
    np.testing.assert_allclose(out.copy_to_host(), ref_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[[0, 4]], whole[[0, 4]], rtol=1e-4, atol=1e-5)
    for slot, rows in ((1, 2), (2, 3)):
        _, part = _delta_seq_reference(u, a, b, ssm_a, dt_bias, state, SNAP_SLOTS, SNAP_LO,
                                       [3, rows], n_k, True)
        np.testing.assert_allclose(got[slot], part[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got[[3, 5]], state[[3, 5]])
