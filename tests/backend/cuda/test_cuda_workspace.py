"""StackedLinears (the CUDA model's projections that share an input) in the simulator, against
numpy on the dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from sparkinfer_cli.backend.cuda.cache import PoolShape
from sparkinfer_cli.backend.cuda.linears import LINEAR_MMA_MIN_ROWS
from sparkinfer_cli.backend.cuda.weights import Uploader, one_row
from sparkinfer_cli.backend.cuda.workspace import Workspace
from sparkinfer_cli.gguf.ggml_types import GGMLType
from sparkinfer_cli.kernels.cuda import quant_gemv as qg
from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.weights import QTensor


def quantized_weight(rng, ggml_type: GGMLType, n_rows: int, k: int) -> QTensor:
    w = (rng.standard_normal((n_rows, k)) * 0.03).astype(np.float32)
    return QTensor("w", ggml_type, (k, n_rows), quantize(w, ggml_type))


def test_stacked_linears_of_several_weight_types_fill_each_members_output():
    """Q8_0, Q4_0, Q8_0 and an F32 vector: three stacks (the ones after the first go to the side
    stream on a GPU; the simulator has one stream), each member's rows in its own buffer."""
    rng = np.random.default_rng(21)
    k, n_rows = 256, 2
    vector = QTensor("v", GGMLType.F32, (k,), rng.standard_normal(k).astype(np.float32))
    members = [quantized_weight(rng, GGMLType.Q8_0, 8, k),
               quantized_weight(rng, GGMLType.Q4_0, 4, k),
               quantized_weight(rng, GGMLType.Q8_0, 4, k), one_row(vector)]
    stacked = Uploader(exact=False).stacked([(m, None) for m in members])
    assert len(stacked.stacks) == 3  # the path under test
    ws = Workspace(n_rows, PoolShape(1, 16, 1, 0), k, True, 0, 0)
    x = rng.standard_normal((1, n_rows, k)).astype(np.float32)  # (groups, cols, k)
    ws.x.f.copy_to_device(x)
    ws.x.quantize(0)
    outs = stacked(ws, ws.x, ("a", "b", "c", "d"), 0)
    q, d, _ = qg.quantize_q8_reference(x[0])
    x_q8 = (q.reshape(*d.shape, 32) * d[..., None]).reshape(x[0].shape)  # what the GEMV reads
    for w, out in zip(members, outs):
        if w.ggml_type == GGMLType.F32:  # float activations
            ref = x[0].astype(np.float64) @ np.asarray(w.raw).T
        else:
            ref = x_q8.astype(np.float64) @ dequantize(w.raw, w.ggml_type).T
        np.testing.assert_allclose(out.copy_to_host().reshape(ref.shape), ref, rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.slow  # the simulator runs a GEMM block's 256 threads one by one: ~20 s each
@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_0, GGMLType.Q8_0])
def test_a_linear_of_enough_tokens_runs_on_tensor_cores(ggml_type):
    """32 tokens: the linear picks a tensor-core GEMM (Q4_0: mma_gemm on f16 activations; Q8_0:
    mmq_q8 on the q8 activations, as the GEMVs read them) and computes W·x."""
    rng = np.random.default_rng(5)
    k, n_out, n_tokens = 256, 128, LINEAR_MMA_MIN_ROWS
    member = quantized_weight(rng, ggml_type, n_out, k)
    lin = Uploader(exact=False).linear(member)
    ws = Workspace(n_tokens, PoolShape(1, 16, 1, 0), k, True, 0, 0)
    assert lin.on_tensor_cores(ws, n_tokens) and not lin.on_tensor_cores(ws, n_tokens - 1)
    x = rng.standard_normal((ws.groups, ws.cols, k)).astype(np.float32)
    ws.x.f.copy_to_device(x)
    ws.x.quantize(0)
    y = ws.buf("y", ws.groups, ws.cols, n_out)
    lin(ws, ws.x, y, 0)
    rows = x.reshape(n_tokens, k)
    if lin.reads_q8(ws, n_tokens):  # int8 tensor cores: the q8 activations
        q, d, _ = qg.quantize_q8_reference(rows)
        rows = (q.reshape(*d.shape, 32) * d[..., None]).reshape(rows.shape)
    ref = rows.astype(np.float64) @ dequantize(member.raw, ggml_type).T
    np.testing.assert_allclose(y.copy_to_host().reshape(ref.shape), ref, rtol=2e-3, atol=2e-3)


def test_a_long_pass_over_a_linear_with_an_f16_copy_runs_gemm_f16(monkeypatch):
    """With f16 copies on, a linear asked for one (prefill=True, enough rows) keeps its weights
    as f16; from F16_GEMM_MIN_ROWS tokens it multiplies them by the f16-rounded activations (its
    outputs beside the bias), below that it keeps the quantized path; without prefill=True or
    with copies off it keeps no copy."""
    from sparkinfer_cli.backend.cuda import linears, weights
    from sparkinfer_cli.kernels.cuda import gemm_f16

    monkeypatch.setattr(weights, "F16_COPY_MIN_ROWS", 64)
    monkeypatch.setattr(linears, "F16_GEMM_MIN_ROWS", 32)
    rng = np.random.default_rng(7)
    k, n_out, n_tokens = 64, 72, 32
    member = quantized_weight(rng, GGMLType.Q8_0, n_out, k)
    bias = QTensor("b", GGMLType.F32, (n_out,), rng.standard_normal(n_out).astype(np.float32))
    assert Uploader(exact=False, f16_copies=True).linear(member, bias).half is None
    assert Uploader(exact=False).linear(member, bias, prefill=True).half is None
    lin = Uploader(exact=False, f16_copies=True).linear(member, bias, prefill=True)
    assert lin.half is not None
    ran, matmul = [], gemm_f16.matmul
    monkeypatch.setattr(gemm_f16, "matmul", lambda *a, **kw: ran.append(True) or matmul(*a, **kw))
    ws = Workspace(n_tokens, PoolShape(1, 16, 1, 0), k, True, 0, 0)
    x = rng.standard_normal((ws.groups, ws.cols, k)).astype(np.float32)
    ws.x.f.copy_to_device(x)
    ws.x.quantize(0)
    y = ws.buf("y", ws.groups, ws.cols, n_out)
    lin(ws, ws.x, y, 0)
    assert ran and not lin.reads_q8(ws, n_tokens)
    rows = x.reshape(n_tokens, k).astype(np.float16).astype(np.float64)
    w16 = dequantize(member.raw, GGMLType.Q8_0).astype(np.float16).astype(np.float64)
    ref = rows @ w16.T + bias.raw
    np.testing.assert_allclose(y.copy_to_host().reshape(ref.shape), ref, rtol=1e-4, atol=1e-4)
    assert lin.reads_q8(ws, n_tokens - 1)  # fewer tokens: the quantized path again


def test_a_queued_decode_pass_stages_its_inputs_and_takes_device_token_ids():
    """A 3-sequence decode in a bucket of 4 staged in staging row 2 (as the third queued pass of
    CudaModel.decode_greedy): the device gets its token ids (-1 on the padding row: a zero
    embedding), positions, lengths and KV slots; no host embeddings are copied; then the
    previous pass's ids replace the placeholders on the device."""
    from numba import cuda

    from sparkinfer_cli.kernels.cuda.runtime.driver_calls import copy_device_async
    from sparkinfer_cli.model.batch import SequenceBatch

    pool = PoolShape(num_blocks=9, block_size=4, scratch_block=9, scratch_slot=3)
    ws = Workspace(4, pool, 32, True, 0, 0)
    tables = [np.array([5, 2]), np.array([7]), np.array([1, 8, 0])]
    batch = SequenceBatch(np.array([11, 12, 13], np.int32), [5, 0, 9], [1, 1, 1], tables,
                          [0, 1, 2])
    ws.h.copy_to_device(np.full(ws.h.shape, 7.0, np.float32))
    ws.fill(batch, None, step=2)
    ws.upload(0, step=2)
    assert ws.token_ids.copy_to_host().tolist() == [11, 12, 13, -1]
    assert ws.positions.copy_to_host().tolist() == [5, 0, 9, 0]
    assert ws.seq_lens.copy_to_host().tolist() == [6, 1, 10, 1]
    # position p of a sequence: block table[p // 4], slot p % 4; the padding row: scratch
    assert ws.slot_mapping.copy_to_host().tolist() == [2 * 4 + 1, 7 * 4 + 0, 0 * 4 + 1, 9 * 4]
    assert (ws.h.copy_to_host() == 7.0).all()  # the device looks the embeddings up
    previous = cuda.to_device(np.array([21, 22, 23, 24], np.int32))  # a pass's argmax (bucket)
    copy_device_async(ws.token_ids[:3], previous[:3], 0)
    assert ws.token_ids.copy_to_host().tolist() == [21, 22, 23, -1]


def test_device_sampling_stages_a_pass_rows_then_argmax_again():
    from sparkinfer_cli.backend.cuda.workspace import DeviceSampling
    from sparkinfer_cli.model.batch import DeviceDraw, SamplingRows

    sampling = DeviceSampling(4, 300)

    def params() -> list[list[float]]:
        return [p.copy_to_host().tolist() for p in sampling.params]

    greedy = [[0.0] * 4, [0] * 4, [1.0] * 4, [0.0] * 4, [0.0] * 4]
    assert params() == greedy
    sampling.stage(SamplingRows.of([DeviceDraw(0.5, 20, 0.9, 0.05, 0.25),
                                    DeviceDraw(0.0, 0, 1.0, 0.0, 0.0)]), 0)
    assert params() == [[0.5, 0, 0, 0], [20, 0, 0, 0], [np.float32(0.9), 1, 1, 1],
                        [np.float32(0.05), 0, 0, 0], [0.25, 0, 0, 0]]
    sampling.stage(None, 0)
    assert params() == greedy


def test_a_pass_uploads_the_tables_of_its_sequences_and_a_scratch_row_after_them():
    """Block tables: row i holds sequence i's blocks then the scratch block, row S (the padding
    rows' sequence) only the scratch block, after a pass with more sequences too."""
    from sparkinfer_cli.model.batch import SequenceBatch

    pool = PoolShape(num_blocks=9, block_size=4, scratch_block=9, scratch_slot=3)
    ws = Workspace(8, pool, 32, True, 0, 0)
    three = SequenceBatch(np.array([1, 2, 3], np.int32), [0, 0, 0], [1, 1, 1],
                          [np.array([4]), np.array([5]), np.array([6])], [0, 1, 2])
    ws.fill(three, None)
    ws.upload(0)
    one = SequenceBatch(np.arange(6, dtype=np.int32), [2], [6], [np.array([7, 3])], [0])
    ws.fill(one, None)
    ws.upload(0)
    tables = ws.block_tables.copy_to_host()  # (8, 10)
    assert tables[0].tolist() == [7, 3] + [9] * 8
    assert tables[1].tolist() == [9] * 10
    assert ws.slot_mapping.copy_to_host()[:6].tolist() == [7 * 4 + 2, 7 * 4 + 3] + \
        [3 * 4 + i for i in range(4)]


def test_device_sampling_stages_grammar_masks_then_allows_every_token_again():
    from sparkinfer_cli.backend.cuda.workspace import DeviceSampling
    from sparkinfer_cli.model.batch import ALL_ALLOWED, ARGMAX, SamplingRows

    sampling = DeviceSampling(3, 70)  # 3 mask words a row
    assert (sampling.allowed.copy_to_host() == ALL_ALLOWED).all()
    mask = np.array([5, 0, 1 << 3], np.uint32)  # tokens 0, 2 and 67
    sampling.stage(SamplingRows.of([ARGMAX, ARGMAX], [None, mask]), 0)
    staged = sampling.allowed.copy_to_host()
    np.testing.assert_array_equal(staged[1], mask)
    assert (staged[[0, 2]] == ALL_ALLOWED).all()
    sampling.stage(SamplingRows.of([ARGMAX]), 0)  # a pass without grammars
    assert (sampling.allowed.copy_to_host() == ALL_ALLOWED).all()


def test_sampling_rows_spread_draws_over_a_pass_and_argmax_elsewhere():
    """The engine's draws for the sequences that sample, placed at their positions in the pass;
    the other sequences take the argmax draw."""
    from sparkinfer_cli.model.batch import ARGMAX, DeviceDraw, SamplingRows

    draws = [DeviceDraw(0.7, 5, 0.9, 0.0, 0.125), DeviceDraw(1.1, 3, 1.0, 0.05, 0.5)]
    spread = SamplingRows.of(draws).spread(4, [1, 3])
    assert len(spread) == 4
    assert [d.top_k for d in spread] == [ARGMAX.top_k, 5, ARGMAX.top_k, 3]
    np.testing.assert_array_equal(spread.uniform, np.float32([0.0, 0.125, 0.0, 0.5]))
    assert spread.temperature.dtype == np.float32 and spread.top_k.dtype == np.int32


def test_a_pass_stages_the_slot_of_each_row_whose_state_a_check_keeps():
    """Two sequences, the second a fed token and 2 drafts (draft_state_slots: the states after
    its first two rows): the device's row_state_slots name those slots on those rows, −1 on
    every other row, padding included."""
    ws = Workspace(8, PoolShape(4, 16, 1, 0), 64, True, 0, 0)
    table = np.arange(2, dtype=np.int32)
    batch = SequenceBatch(np.arange(5, dtype=np.int32), [3, 7], [2, 3], [table, table], [0, 1],
                          logit_counts=[1, 3], draft_state_slots=[(), (5, 6)])
    ws.fill(batch, None)
    ws.upload(0)
    assert ws.row_state_slots.copy_to_host().tolist() == [-1, -1, 5, 6, -1, -1, -1, -1]


def test_a_multi_token_pass_stages_its_chunk_list_where_the_model_runs_chunked_kernels():
    """Sequences of 40 and 3 new tokens: chunk_lo / chunk_n list each sequence's chunks of
    gated_delta_chunked.CHUNK rows, −1 / 0 after them."""
    from sparkinfer_cli.kernels.cuda import gated_delta_chunked as gdc

    ws = Workspace(48, PoolShape(8, 16, 1, 0), 64, True, 0, 0, lists_chunks=True)
    tables = [np.arange(3, dtype=np.int32), np.arange(3, 4, dtype=np.int32)]
    batch = SequenceBatch(np.arange(43, dtype=np.int32), [0, 5], [40, 3], tables, [0, 1])
    ws.fill(batch, None)
    ws.upload(0)
    lo, n, C = ws.chunk_lo.copy_to_host(), ws.chunk_n.copy_to_host(), gdc.CHUNK
    assert lo[:3].tolist() == [0, C, 40] and (lo[3:] == -1).all()
    assert n[:3].tolist() == [C, 40 - C, 3] and (n[3:] == 0).all()
