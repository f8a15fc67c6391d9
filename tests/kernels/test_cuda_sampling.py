"""CUDA greedy and top-k/top-p/min-p sampling vs numpy."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from sparkinfer_cli.kernels.cuda import sampling


@pytest.mark.parametrize("n_vocab", [300, pytest.param(248320, marks=pytest.mark.gpu)])
def test_greedy_and_filtered_sampling(n_vocab):
    rng = np.random.default_rng(10)
    logits = rng.standard_normal((4, n_vocab)).astype(np.float32) * 3
    logits[0, 17] = logits[0, 250] = 50.0  # greedy tie → lowest id
    temperature = np.array([0.0, 0.7, 1.0, 1.3], np.float32)
    top_k = np.array([0, 5, 3, 6], np.int32)
    top_p = np.array([1.0, 0.9, 1.0, 0.5], np.float32)
    min_p = np.array([0.0, 0.0, 0.2, 0.0], np.float32)
    uniform = np.array([0.5, 0.97, 0.6, 0.3], np.float32)
    out = cuda.device_array(4, np.int32)
    arrays = (logits, temperature, top_k, top_p, min_p, uniform)
    ws = sampling.SamplingWorkspace(4, n_vocab)
    sampling.sample(*(cuda.to_device(a) for a in arrays), out, ws)
    got = out.copy_to_host()
    np.testing.assert_array_equal(got, sampling.sample_reference(*arrays))
    assert got[0] == 17
