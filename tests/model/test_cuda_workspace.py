"""Workspace.linears (the CUDA model's projections that share an input) in the simulator, against
numpy on the dequantized weights."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from gguf.quants import dequantize, quantize

from sparkinfer_cli.ggml_types import GGMLType
from sparkinfer_cli.kernels.cuda import quant_gemv as qg
from sparkinfer_cli.model.cuda_weights import Uploader
from sparkinfer_cli.model.cuda_workspace import Workspace
from sparkinfer_cli.model.layers import Linear
from sparkinfer_cli.model.weights import QTensor


def quantized_linear(rng, ggml_type: GGMLType, n_rows: int, k: int) -> Linear:
    w = (rng.standard_normal((n_rows, k)) * 0.03).astype(np.float32)
    return Linear(QTensor("w", ggml_type, (k, n_rows), quantize(w, ggml_type)))


def test_stacked_linears_of_several_weight_types_fill_each_members_output():
    """Q8_0, Q4_0, Q8_0 and an F32 vector: three stacks (the ones after the first go to the side
    stream on a GPU; the simulator has one stream), each member's rows in its own buffer."""
    rng = np.random.default_rng(21)
    k, n_rows = 256, 2
    members = [quantized_linear(rng, GGMLType.Q8_0, 8, k),
               quantized_linear(rng, GGMLType.Q4_0, 4, k),
               quantized_linear(rng, GGMLType.Q8_0, 4, k),
               rng.standard_normal(k).astype(np.float32)]
    stacked = Uploader(exact=False).stacked(members)
    assert len(stacked.stacks) == 3  # the path under test
    ws = Workspace(n_rows, SimpleNamespace(num_blocks=1), k, True, 0, 0)
    x = rng.standard_normal((1, n_rows, k)).astype(np.float32)  # (groups, cols, k)
    ws.x.f.copy_to_device(x)
    ws.x.quantize(0)
    outs = ws.linears(stacked, ws.x, ("a", "b", "c", "d"), 0)
    q, d, _ = qg.quantize_q8_reference(x[0])
    x_q8 = (q.reshape(*d.shape, 32) * d[..., None]).reshape(x[0].shape)  # what the GEMV reads
    for member, out in zip(members, outs):
        if isinstance(member, np.ndarray):  # F32: float activations
            ref = x[0].astype(np.float64) @ member
        else:
            w = member.weight
            ref = x_q8.astype(np.float64) @ dequantize(w.raw, w.ggml_type).T
        np.testing.assert_allclose(out.copy_to_host().reshape(ref.shape), ref, rtol=1e-4,
                                   atol=1e-5)
