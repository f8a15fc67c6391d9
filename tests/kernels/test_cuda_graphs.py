"""CUDA graph replay equals the eager chain: a GEMV → RMSNorm → SwiGLU chain, and a chain with a
branch on the side stream (H200 only)."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_graph_replay_matches_eager_and_is_cheap_on_the_host():
    from numba import cuda
    from test_cuda_quant_gemv import random_weights

    from sparkinfer_cli.gguf.ggml_types import GGMLType
    from sparkinfer_cli.kernels.cuda import activation, norm
    from sparkinfer_cli.kernels.cuda import quant_gemv as qg
    from sparkinfer_cli.kernels.cuda.runtime import graphs
    from sparkinfer_cli.kernels.cuda.runtime.launch import to_device_bytes

    rng = np.random.default_rng(11)
    k, n = 2048, 1024
    w = qg.DeviceQuantMatrix(to_device_bytes(random_weights(GGMLType.Q4_K, 2 * n, k, rng)),
                             GGMLType.Q4_K, k, 2 * n)
    stream = cuda.stream()
    x = cuda.to_device(rng.standard_normal((1, 1, k)).astype(np.float32))
    act = qg.QuantizedActivations(1, 1, k)
    y = cuda.device_array((1, 1, 2 * n), np.float32)
    normed = cuda.device_array((1, 1, 2 * n), np.float32)
    out = cuda.device_array(n, np.float32)
    weight = cuda.to_device(np.ones(2 * n, np.float32))

    def chain(s):
        qg.quantize_activations(x, act, stream=s)
        qg.gemv(w, act, y, stream=s)
        norm.rms_norm(y, weight, normed, 1e-6, stream=s)
        flat = normed.reshape(2 * n)
        activation.swiglu(flat[:n], flat[n:], out, stream=s)

    chain(stream)
    stream.synchronize()
    eager = out.copy_to_host()
    out.copy_to_device(np.zeros(n, np.float32))
    graph = graphs.capture(chain, stream)
    graph.replay()
    stream.synchronize()
    np.testing.assert_array_equal(out.copy_to_host(), eager)

    n_replays = 2000
    t0 = time.perf_counter()
    for _ in range(n_replays):
        graph.replay()
    host_us = (time.perf_counter() - t0) / n_replays * 1e6
    stream.synchronize()
    print(f"graph of 5 kernels: {host_us:.1f} us host time per replay")
    assert host_us < 50


def test_side_stream_branch_is_ordered_inside_a_captured_graph():
    # main: quantize x → fork → [side: GEMV of W2] ∥ [main: GEMV of W] → join → SwiGLU of both.
    # Replayed after every buffer is zeroed: the side GEMV must see this replay's activations
    # (fork edge) and the SwiGLU both GEMVs' outputs (join edge).
    from numba import cuda
    from test_cuda_quant_gemv import random_weights

    from sparkinfer_cli.gguf.ggml_types import GGMLType
    from sparkinfer_cli.kernels.cuda import activation
    from sparkinfer_cli.kernels.cuda import quant_gemv as qg
    from sparkinfer_cli.kernels.cuda.runtime import graphs
    from sparkinfer_cli.kernels.cuda.runtime.launch import to_device_bytes

    rng = np.random.default_rng(12)
    k, n = 2048, 16384
    w, w2 = (qg.DeviceQuantMatrix(to_device_bytes(random_weights(GGMLType.Q4_K, n, k, rng)),
                                  GGMLType.Q4_K, k, n) for _ in range(2))
    stream, side = cuda.stream(), graphs.side_stream()
    x = cuda.to_device(rng.standard_normal((1, 1, k)).astype(np.float32))
    act = qg.QuantizedActivations(1, 1, k)
    y, y2 = (cuda.device_array((1, 1, n), np.float32) for _ in range(2))
    out = cuda.device_array(n, np.float32)

    def chain(s, branch):
        qg.quantize_activations(x, act, stream=s)
        qg.gemv(w2, act, y2, stream=branch.fork(s))
        qg.gemv(w, act, y, stream=s)
        branch.join(s)
        activation.swiglu(y.reshape(n), y2.reshape(n), out, stream=s)

    chain(stream, graphs.SameStream())
    stream.synchronize()
    expected = out.copy_to_host()
    graph = graphs.capture(lambda s: chain(s, side), stream)
    for arr in (act.xq, act.xd, act.xs, y, y2, out):
        arr.copy_to_device(np.zeros(arr.shape, arr.dtype))
    graph.replay()
    stream.synchronize()
    np.testing.assert_array_equal(out.copy_to_host(), expected)
