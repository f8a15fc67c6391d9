"""A hybrid model's pass that checks drafts keeps the recurrent state after each checked row in
the slots the batch names (SequenceBatch.draft_state_slots), so that after a rejected draft the
sequence goes on from the state at the last kept token without running any token again. Tiny
qwen35 GGUF (Gated DeltaNet layers) on the runtime CPU model, bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.loader import load_runtime_model

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
BLOCK_SIZE = 16


def test_a_check_keeps_the_state_after_each_row_it_checks() -> None:
    model = load_runtime_model(GGUFFile(TINY / "qwen35" / "qwen35-Q8_0.gguf"), "cpu")
    assert model.snapshots_draft_states and model.config.is_hybrid
    ids = (np.arange(24) * 37 % 480).astype(np.int32)
    prompt, check = ids[:17], ids[17:21]  # a fed token and 3 drafts
    blocks = np.arange(2, dtype=np.int32)

    def cache_after(prompt_tokens: np.ndarray):
        cache = model.create_cache(len(blocks), BLOCK_SIZE, 4)
        model.forward(SequenceBatch.single(prompt_tokens, 0, blocks), cache)
        return cache

    cache = cache_after(prompt)
    batch = SequenceBatch(check, [len(prompt)], [len(check)], [blocks], [0], logit_counts=[4],
                          draft_state_slots=[(1, 2, 3)])
    rows = model.forward(batch, cache)
    plain = cache_after(prompt)
    np.testing.assert_array_equal(rows, model.forward(
        SequenceBatch(check, [len(prompt)], [len(check)], [blocks], [0], logit_counts=[4]),
        plain))  # the same rows as a pass that keeps no states
    for slot, kept in ((1, 0), (2, 1), (3, 2), (0, 3)):  # slot → drafts run into its state
        alone = cache_after(ids[:len(prompt) + 1 + kept])
        assert alone.conv_state.shape[0] > 0
        np.testing.assert_array_equal(cache.conv_state[:, slot], alone.conv_state[:, 0])
        np.testing.assert_array_equal(cache.delta_state[:, slot], alone.delta_state[:, 0])
