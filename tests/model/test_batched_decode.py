"""A decode step of several sequences in one pass (what the server runs for its clients) gives each
sequence the logits it gets decoded alone, bit for bit: the batched int8 matmul, the row-by-row
small ops and the per-sequence attention keep every token's arithmetic its own. More sequences
than one matmul call takes (MAX_ROWS) and prompts of different lengths, tiny synthetic models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sparkinfer_cli.gguf.synthetic import write_synthetic
from sparkinfer_cli.kernels.cpu.quant_packed import MAX_ROWS
from sparkinfer_cli.model.base import CausalLM
from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.loader import load_model

BLOCK_SIZE = 4
NUM_SEQS = MAX_ROWS + 2
PROMPT_LENGTHS = [3 + 5 * i % 11 for i in range(NUM_SEQS)]
NUM_STEPS = 3


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen35"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    path = write_synthetic(tmp_path_factory.mktemp("batched") / "model.gguf", request.param, seed=5)
    return load_model(Path(path), int8_decode=True)


def _tables(seq: int) -> np.ndarray:
    """Sequence seq's blocks, interleaved with the others' in the pool."""
    n = -(-(max(PROMPT_LENGTHS) + NUM_STEPS) // BLOCK_SIZE)
    return (np.arange(n) * NUM_SEQS + seq).astype(np.int32)  # (blocks,)


def _prefill(model: CausalLM, prompts: list[np.ndarray]):
    cache = model.create_cache(NUM_SEQS * len(_tables(0)), BLOCK_SIZE, NUM_SEQS)
    for i, p in enumerate(prompts):
        model.forward(SequenceBatch.single(p, 0, _tables(i), i), cache)
    return cache


def test_decode_step_of_many_sequences_equals_each_alone(model: CausalLM) -> None:
    rng = np.random.default_rng(0)
    V = model.config.n_vocab
    prompts = [rng.integers(0, V, n).astype(np.int32) for n in PROMPT_LENGTHS]
    steps = rng.integers(0, V, (NUM_STEPS, NUM_SEQS)).astype(np.int32)  # fed tokens
    batched_cache, alone_cache = _prefill(model, prompts), _prefill(model, prompts)
    for step, ids in enumerate(steps):
        starts = [n + step for n in PROMPT_LENGTHS]
        batch = SequenceBatch(ids, starts, [1] * NUM_SEQS, [_tables(i) for i in range(NUM_SEQS)],
                              list(range(NUM_SEQS)))
        together = model.forward(batch, batched_cache)  # (NUM_SEQS, V)
        for i in range(NUM_SEQS):
            alone = model.forward(SequenceBatch.single(ids[i:i + 1], starts[i], _tables(i), i),
                                  alone_cache)
            np.testing.assert_array_equal(together[i], alone[0], f"step {step}, sequence {i}")
