"""The chunked CUDA delta rule (gated_delta_chunked) against the float64 reference, on inputs
prepared in numpy (q, k L2-normalised, q / sqrt(dk), log-decay, β), and through delta_rule_seq."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from test_cuda_gated_delta import (
    _delta_inputs,
    _delta_seq_reference,
    _run_delta_seq,
    assert_f16_close,
)

from sparkinfer_cli.kernels.cuda import gated_delta_chunked as gdc
from sparkinfer_cli.kernels.delta_rule_reference import delta_rule


def _prepared(rng, rows: int, n_k: int, n_v: int, dk: int, dv: int):
    """Prepared inputs as the kernel reads them: u = q̂ | k̂ | v, a = log-decay, b = β."""
    q, k = (rng.standard_normal((rows, n_k, dk)) for _ in range(2))
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((rows, n_v, dv))
    log_decay = -rng.uniform(0.01, 0.6, (rows, n_v))
    beta = rng.uniform(0.1, 0.9, (rows, n_v))
    u = np.concatenate([q.reshape(rows, -1), k.reshape(rows, -1), v.reshape(rows, -1)], axis=1)
    return (u.astype(np.float32), log_decay.astype(np.float32), beta.astype(np.float32),
            q * np.sqrt(dk), k, v)


def _reference(q, k, v, log_decay, beta, state, slots, lo, n, head_map_mod):
    """Each sequence through the reference; state (slots, n_v, dv, dk) as the CUDA cache."""
    out = np.zeros((q.shape[0], v.shape[1], v.shape[2]))
    new_state = state.astype(np.float64).copy()
    for s in range(len(n)):
        rows = slice(lo[s], lo[s] + n[s])
        o, st = delta_rule(q[rows], k[rows], v[rows], log_decay[rows], beta[rows],
                           np.swapaxes(new_state[slots[s]], 1, 2), head_map_mod)
        out[rows], new_state[slots[s]] = o, np.swapaxes(st, 1, 2)
    return out, new_state


def _chunked_pass(scratch: np.ndarray, lo: list[int], n: list[int], chunk: int):
    """The scratch and chunk list on the device, for rows as many as the scratch's."""
    lists = np.empty((2, scratch.shape[0]), np.int32)
    gdc.chunk_list(np.asarray(lo), np.asarray(n), lists[0], lists[1], chunk)
    return gdc.ChunkedPass(cuda.to_device(scratch), *(cuda.to_device(x) for x in lists))


def test_chunk_list_holds_each_sequence_s_chunks_in_order():
    lists = np.full((2, 8), 9, np.int32)
    gdc.chunk_list(np.array([5, 0, 40]), np.array([33, 1, 16]), lists[0], lists[1], 16)
    assert lists[0].tolist() == [5, 21, 37, 0, 40, -1, -1, -1]
    assert lists[1].tolist() == [16, 16, 1, 1, 16, 0, 0, 0]


@pytest.mark.parametrize("chunk, cols, head_map_mod", [
    (16, 16, False),  # a head's columns over several recurrence blocks
    (gdc.CHUNK, None, True),  # a block takes all of a head's columns
])
@pytest.mark.slow
def test_chunked_delta_rule_matches_reference(chunk, cols, head_map_mod):
    """Sequences of several chunks and a partial last one, a 1-token sequence, an empty entry
    after them (the kernels stop there), an untouched slot; rows no sequence owns keep their old
    output."""
    rng = np.random.default_rng(11)
    n_k, n_v, dk, dv, rows = 1, 2, 32, 64, 41
    u, log_decay, beta, q, k, v = _prepared(rng, rows, n_k, n_v, dk, dv)
    state = (rng.standard_normal((4, n_v, dv, dk)) * 0.1).astype(np.float32)
    slots, lo, n = [2, 0, 1, 3], [1, 20, 21, 0], [19, 1, 20, 0]  # row 0 belongs to nobody
    dev_state = cuda.to_device(state)
    out = cuda.to_device(np.full((rows, n_v, dv), 7, np.float32))
    scratch = np.full((rows, n_v, gdc.scratch_cols(dk, dv, chunk)), np.nan,
                      np.float32)  # what the kernels read, they wrote first
    gdc.delta_rule_chunked(*(cuda.to_device(x) for x in (u, log_decay, beta)), dev_state,
                           *(cuda.to_device(np.asarray(x, np.int32)) for x in (slots, lo, n)),
                           out, _chunked_pass(scratch, lo, n, chunk), n_k_heads=n_k,
                           head_map_mod=head_map_mod, chunk=chunk, cols=cols)
    ref_out, ref_state = _reference(q, k, v, log_decay, beta, state, slots, lo, n, head_map_mod)
    got_state = dev_state.copy_to_host()
    assert_f16_close(out.copy_to_host()[1:], ref_out[1:])
    np.testing.assert_array_equal(out.copy_to_host()[0], 7)
    assert_f16_close(got_state, ref_state)
    np.testing.assert_array_equal(got_state[3], state[3])


@pytest.mark.slow
def test_chunks_of_64_tokens_match_reference():
    """64-token chunks: (I + A)⁻¹ over two warps' columns, a sequence of a whole chunk and a
    partial one, another of a partial one alone."""
    rng = np.random.default_rng(13)
    n_k, n_v, dk, dv, rows = 1, 1, 16, 16, 80
    u, log_decay, beta, q, k, v = _prepared(rng, rows, n_k, n_v, dk, dv)
    state = (rng.standard_normal((2, n_v, dv, dk)) * 0.1).astype(np.float32)
    slots, lo, n = [1, 0], [0, 70], [70, 10]
    dev_state = cuda.to_device(state)
    out = cuda.device_array((rows, n_v, dv), np.float32)
    scratch = np.zeros((rows, n_v, gdc.scratch_cols(dk, dv, 64)), np.float32)
    gdc.delta_rule_chunked(*(cuda.to_device(x) for x in (u, log_decay, beta)), dev_state,
                           *(cuda.to_device(np.asarray(x, np.int32)) for x in (slots, lo, n)),
                           out, _chunked_pass(scratch, lo, n, 64), n_k_heads=n_k,
                           head_map_mod=True, chunk=64)
    ref_out, ref_state = _reference(q, k, v, log_decay, beta, state, slots, lo, n, True)
    assert_f16_close(out.copy_to_host(), ref_out)
    assert_f16_close(dev_state.copy_to_host(), ref_state)


@pytest.mark.slow
def test_delta_rule_seq_chunked_prepares_and_matches_reference():
    """delta_rule_seq(prepare, chunked): the prepare step writes log-decays for the chunked
    kernel; a 35-token sequence spans two chunks."""
    rng = np.random.default_rng(12)
    n_k, n_v, dk, dv = 1, 2, 32, 64
    u, a, b, ssm_a, dt_bias, state = _delta_inputs(rng, 37, n_k, n_v, dk, dv, slots=3)
    slots, lo, n = [2, 0], [0, 35], [35, 2]
    out, new_state = _run_delta_seq(u, a, b, ssm_a, dt_bias, state, slots, lo, n, n_k, True,
                                    prepare=True, chunked=True)
    ref_out, ref_state = _delta_seq_reference(u, a, b, ssm_a, dt_bias, state, slots, lo, n, n_k,
                                              True)
    assert_f16_close(out, ref_out)
    assert_f16_close(new_state, ref_state)
