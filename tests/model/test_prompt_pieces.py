"""A prompt's logits do not depend on the pieces it is computed in: the server's step budget cuts
prompts where its load puts the cut, and a prefix-cache hit starts one at a block, so a token's
numbers must be the same whatever piece it came in (issue 31: greedy answers differed with the
load). Tiny test GGUFs on the runtime CPU model, bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.loader import load_runtime_model

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
BLOCK_SIZE = 16
PROMPT_TOKENS = 120


@pytest.mark.parametrize("family", ["qwen3", "qwen35"])  # attention; gated attention (hybrid)
def test_a_prompts_last_logits_do_not_depend_on_its_pieces(family: str) -> None:
    model = load_runtime_model(GGUFFile(TINY / family / f"{family}-Q8_0.gguf"), "cpu")
    ids = (np.arange(PROMPT_TOKENS) * 37 % 480).astype(np.int32)
    blocks = np.arange(-(-PROMPT_TOKENS // BLOCK_SIZE), dtype=np.int32)

    def last_logits(piece: int) -> np.ndarray:
        cache = model.create_cache(len(blocks), BLOCK_SIZE, 1)
        for lo in range(0, PROMPT_TOKENS, piece):
            logits = model.forward(SequenceBatch.single(ids[lo:lo + piece], lo, blocks), cache)
        return logits[-1]

    whole = last_logits(PROMPT_TOKENS)
    for piece in (48, 37, 5):  # cut at a block, anywhere, and in pieces short enough to decode
        np.testing.assert_array_equal(last_logits(piece), whole, f"pieces of {piece}")
