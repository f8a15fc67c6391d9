"""CUDA greedy and top-k/top-p/min-p sampling vs the host Sampler's own truncation and draw
(engine/truncation.py), given the same uniform u."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from sparkinfer_cli.engine.truncation import choose, thread_workspace, truncate
from sparkinfer_cli.kernels.cuda import sampling

N_ROWS = 6
BOUNDARY = 1e-4  # u this close (relative) to a cumulative boundary may round either way


def _host_choice(row: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float,
                 u: float) -> tuple[int, float]:
    """(token, distance of u from the nearest boundary of the kept cumulative weights)."""
    if temperature <= 0:
        return int(np.argmax(row)), 1.0
    ws = thread_workspace(len(row))
    token = choose(row, temperature, top_k, top_p, min_p, u, ws)
    ids = truncate(row, top_k, top_p, min_p, ws)
    kept = row if ids is None else row[ids]
    weights = np.exp((kept - kept.max()) / np.float32(temperature)).astype(np.float64)
    cdf = np.cumsum(weights) / weights.sum()
    return token, float(np.abs(cdf - u).min())


PLANTED = np.arange(10, 90, 10)  # 8 ids whose logits descend with the id: 10.0, 9.5, ..., 6.5


def _rows(n_vocab: int, rng: np.random.Generator, widest: int) -> tuple[np.ndarray, ...]:
    """Background logits N(0, 1); rows 2-3 carry PLANTED, where top-p (row 2) and min-p (row 3)
    cut the 8 candidates to 2 and 4 and a high u then lands on the last kept id."""
    logits = rng.standard_normal((N_ROWS, n_vocab)).astype(np.float32)
    logits[0, 17] = logits[0, 250] = 50.0  # greedy: a tie → the lower id
    logits[1, [3, 40, 41]] = 30.0  # a tie inside the kept candidates
    logits[2:4, PLANTED] = 10.0 - 0.5 * np.arange(8)
    logits[4:, rng.integers(0, n_vocab, 8)] += 4.0  # peaked
    temperature = np.array([0.0, 0.9, 1.0, 1.3, 0.3, 0.7], np.float32)
    top_k = np.array([1, 5, 8, 8, 3, widest], np.int32)
    top_p = np.array([1.0, 1.0, 0.5, 1.0, 1.0, 0.95], np.float32)
    min_p = np.array([0.0, 0.0, 0.0, 0.2, 0.0, 0.05], np.float32)
    uniform = np.array([0.5, rng.random(), 0.9, 0.95, rng.random(), rng.random()], np.float32)
    return logits, temperature, top_k, top_p, min_p, uniform


@pytest.mark.parametrize("n_vocab, widest", [
    (300, 8), pytest.param(248320, sampling.MAX_CANDIDATES, marks=pytest.mark.gpu)])
@pytest.mark.slow
def test_sampling_picks_what_the_host_sampler_picks(n_vocab, widest, rng):
    arrays = _rows(n_vocab, rng, widest)
    out = cuda.device_array(N_ROWS, np.int32)
    ws = sampling.SamplingWorkspace(N_ROWS, n_vocab)
    sampling.sample(*(cuda.to_device(a) for a in arrays), out, ws)
    got = out.copy_to_host()
    compared = 0
    for r, params in enumerate(zip(*arrays[1:])):
        temperature, top_k, top_p, min_p, u = (float(x) for x in params)
        assert sampling.supports_exactly(temperature, int(top_k))
        token, margin = _host_choice(arrays[0][r], temperature, int(top_k), top_p, min_p, u)
        if margin > BOUNDARY:
            assert got[r] == token, f"row {r}: device {got[r]}, host {token}"
            compared += 1
    assert compared >= N_ROWS - 1
    assert got[0] == 17 and got[2] == PLANTED[1] and got[3] == PLANTED[3]
    # the cuts bind: without them the same u picks another token
    logits, temperature = arrays[0], arrays[1]
    assert _host_choice(logits[2], float(temperature[2]), 8, 1.0, 0.0, 0.9)[0] != got[2]
    assert _host_choice(logits[3], float(temperature[3]), 8, 1.0, 0.0, 0.95)[0] != got[3]


def mask_words(allowed: np.ndarray) -> np.ndarray:
    """(rows, n_vocab) bool → the kernel's (rows, words) uint32 bit masks (bit j of word w:
    token 32w + j), as llguidance writes them."""
    bits = np.pad(allowed, ((0, 0), (0, -allowed.shape[1] % 32)))
    return np.packbits(bits, axis=1, bitorder="little").view(np.uint32)


@pytest.mark.slow
def test_a_mask_keeps_refused_tokens_out_of_greedy_and_sampled_picks(rng):
    """The same rows with each row's best tokens refused: the device picks what the host
    sampler picks from the logits with the refused ones at -inf (and never a refused id)."""
    n_vocab = 300
    logits, temperature, top_k, top_p, min_p, uniform = _rows(n_vocab, rng, 8)
    allowed = rng.random((N_ROWS, n_vocab)) < 0.6
    allowed[np.arange(N_ROWS), logits.argmax(axis=1)] = False  # the unmasked pick is refused
    masked = np.where(allowed, logits, -np.inf).astype(np.float32)
    out = cuda.device_array(N_ROWS, np.int32)
    ws = sampling.SamplingWorkspace(N_ROWS, n_vocab)
    arrays = (logits, temperature, top_k, top_p, min_p, uniform)
    sampling.sample(*(cuda.to_device(a) for a in arrays), out, ws,
                    allowed=cuda.to_device(mask_words(allowed)))
    got = out.copy_to_host()
    assert allowed[np.arange(N_ROWS), got].all()
    compared = 0
    for r, params in enumerate(zip(*arrays[1:])):
        t, k, p, m, u = (float(x) for x in params)
        token, margin = _host_choice(masked[r], t, int(k), p, m, u)
        if margin > BOUNDARY:
            assert got[r] == token, f"row {r}: device {got[r]}, host {token}"
            compared += 1
    assert compared >= N_ROWS - 1


def test_wide_top_k_is_not_exact():
    assert not sampling.supports_exactly(0.7, 0)
    assert not sampling.supports_exactly(0.7, sampling.MAX_CANDIDATES + 1)
    assert sampling.supports_exactly(0.0, 0)
