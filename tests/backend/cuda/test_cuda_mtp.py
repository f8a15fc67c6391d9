"""The MTP head on the GPU (backend/cuda/mtp.py) against the CPU head (model/mtp.py), and the
engine's greedy answers with its drafts against those without, on synthetic tiny Qwen3.5 files
with one NextN block (an MoE head, a dense one, and an MoE head in a file of its own). Without a
GPU the head's own first stage runs in numba's simulator (a whole pass is too slow there)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from test_cuda_model import BLOCK_SIZE, DEQF32_TOL, answers_with_and_without_drafts

from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.gguf.synthetic import PRESETS, write_synthetic
from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.loader import checked_config, load_model, mtp_tensors

PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, 470, 60)]


@pytest.fixture(scope="module", params=["tiny-qwen35moe-mtp", "tiny-qwen35-mtp", "head-only"])
def mtp_files(tmp_path_factory, request) -> tuple[Path, Path | None]:
    """(model file, head-only file or None)."""
    folder = tmp_path_factory.mktemp("mtp")
    if request.param != "head-only":
        return write_synthetic(folder / f"{request.param}.gguf", request.param, seed=3), None
    head = dataclasses.replace(PRESETS["tiny-qwen35moe-mtp"], head_only=True)
    return (write_synthetic(folder / "model.gguf", "tiny-qwen35moe", seed=3),
            write_synthetic(folder / "head.gguf", head, seed=4))


def _gpu_model(files: tuple[Path, Path | None], exact: bool):
    from sparkinfer_cli.backend.cuda.model import load_cuda_model
    from sparkinfer_cli.backend.cuda.mtp import CudaMtpHead

    gguf = GGUFFile(files[0])
    config = checked_config(gguf)
    model = load_cuda_model(gguf, config, exact=exact)
    model.mtp = CudaMtpHead(mtp_tensors(gguf, config, files[1]), model)
    return model


def _head_passes(model, tokens: list[int], k: int) -> list[np.ndarray]:
    """The model's logits and hidden states over tokens in one pass, the head over every (hidden
    at p, token p + 1) pair, then k − 1 passes drafting on from its own state: every array."""
    n = len(tokens)
    blocks = np.arange(-(-(n + k) // BLOCK_SIZE), dtype=np.int32)
    batch = SequenceBatch.single(np.asarray(tokens, np.int32), 0, blocks, 0)
    logits, hidden = model.forward_hidden(batch, model.create_cache(len(blocks), BLOCK_SIZE, 1))
    out = [logits, hidden]
    head_cache = model.mtp.create_cache(len(blocks), BLOCK_SIZE)
    rows = np.concatenate([np.zeros_like(hidden[:1]), hidden[:n - 1]])
    for step in range(k):
        head_logits, state = model.mtp.forward(rows, batch, head_cache)
        out += [head_logits, state]
        token = np.array([np.argmax(head_logits[-1])], np.int32)
        rows, batch = state[-1:], SequenceBatch.single(token, n + step, blocks, 0)
    return out


@pytest.mark.gpu
def test_exact_head_passes_match_the_cpu_head(mtp_files) -> None:
    """Exact mode (F32 weights, float activations): the hidden states the model returns, the
    head's logits and states over a prompt's pairs and over its own drafts, as on the CPU."""
    cpu = load_model(mtp_files[0], "cpu", with_mtp=True, mtp_file=mtp_files[1])
    expected = _head_passes(cpu, PROMPT, 3)
    got = _head_passes(_gpu_model(mtp_files, exact=True), PROMPT, 3)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.shape == b.shape, i
        assert np.abs(a - b).max() <= DEQF32_TOL, i


@pytest.mark.gpu
def test_engine_answers_the_same_with_mtp_drafts(mtp_files) -> None:
    """Quantized mode, as the server runs: greedy answers with the head's drafts equal those
    without, alone and together."""
    from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

    model = _gpu_model(mtp_files, exact=False)
    answers, _ = answers_with_and_without_drafts(
        model, Tokenizer.from_gguf(GGUFFile(mtp_files[0])), PROMPT, use_mtp=True)
    assert answers[4, False] == answers[0, False], "alone"
    assert answers[4, True] == answers[0, True], "together"


@pytest.mark.slow
def test_head_input_is_eh_proj_over_the_normed_embedding_and_hidden_rows(tmp_path) -> None:
    """The stage the head adds to a layer (eh_proj as two column halves summed in the residual
    add, then the layer's pre-norm): ws.x equals the CPU head's attn_norm(eh_proj([enorm(e) |
    hnorm(h)])) row by row, padding rows aside."""
    from sparkinfer_cli.backend.cuda.model import CachePasses

    files = (write_synthetic(tmp_path / "m.gguf", "tiny-qwen35moe-mtp", seed=3), None)
    head = _gpu_model(files, exact=True).mtp.passes
    cpu = load_model(files[0], "cpu", with_mtp=True).mtp
    tokens = np.array([5, 17, 301], np.int32)
    hidden = np.random.default_rng(0).standard_normal((3, head.config.n_embd)).astype(np.float32)
    cache = head.create_cache(2, BLOCK_SIZE, 0)
    ws = head._workspace(CachePasses(), cache, 4)
    ws.fill(SequenceBatch.single(tokens, 0, np.arange(1, dtype=np.int32), 0), None)
    ws.upload(head.stream)
    ws.stage_rows_in(hidden, head.stream)
    head._first_input(ws, head.stream)
    got = np.asarray(ws.x.f.copy_to_host(stream=head.stream)).reshape(4, -1)[:3]
    pairs = np.concatenate([cpu.enorm(cpu.trunk.token_embd(tokens)), cpu.hnorm(hidden)], axis=1)
    want = cpu.layer.attn_norm(cpu.eh_proj(pairs))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
