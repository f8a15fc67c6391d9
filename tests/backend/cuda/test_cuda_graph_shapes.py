"""The passes CudaModel.prepare captures before serving cover every pass the engine forms."""

from __future__ import annotations

import pytest

from sparkinfer_cli.backend.cuda.model import (
    DRAFT_PASS_TOKENS,
    MAX_GRAPH_ROWS,
    graph_key,
    graph_shapes,
)
from sparkinfer_cli.backend.cuda.workspace import row_bucket


def _passes(max_seqs: int, max_pass_tokens: int):
    """(tokens, sequences, logit rows) of every pass the engine can form: a logit row a sequence,
    and up to one a token where the pass may check drafts (decodes' drafts stay within
    DRAFT_PASS_TOKENS); decode passes of more than MAX_GRAPH_ROWS sequences run uncaptured."""
    for n_seqs in range(1, max_seqs + 1):
        for n_tokens in range(n_seqs, max_pass_tokens + 1):
            if n_tokens == n_seqs and n_seqs > MAX_GRAPH_ROWS:
                continue
            most = n_tokens if n_tokens <= DRAFT_PASS_TOKENS else n_seqs
            for n_logits in range(n_seqs, most + 1):
                yield n_tokens, n_seqs, n_logits


@pytest.mark.parametrize("fixed_splits", [False, True])
@pytest.mark.parametrize("max_seqs, max_pass_tokens", [(64, 2048), (24, 300), (4, 4096), (1, 16),
                                                       (64, 16)])
def test_graph_shapes_cover_every_pass_of_the_engine(max_seqs, max_pass_tokens, fixed_splits):
    reachable = {graph_key(*p, False, fixed_splits) for p in _passes(max_seqs, max_pass_tokens)}
    shapes = graph_shapes(max_seqs, max_pass_tokens, fixed_splits)
    assert all(n_seqs <= min(max_seqs, n_tokens) and n_seqs <= n_logits <= n_tokens
               for n_tokens, n_seqs, n_logits in shapes)
    captured = [graph_key(*shape, False, fixed_splits) for shape in shapes]
    assert len(captured) == len(set(captured))  # one pass a key
    assert set(captured) >= reachable
    assert all(logits <= rows <= row_bucket(max_pass_tokens)
               for rows, _, logits, _, _ in captured)


def test_rows_of_a_small_pass_take_the_attention_splits_of_their_sequences():
    """A sequence checking 3 drafts (4 rows) splits its keys as a decode of 1 sequence does; 3
    sequences with drafts (12 rows) as a decode of 3 (bucket 4); a large pass by its rows."""
    assert graph_key(4, 1, 4, True)[3] == graph_key(1, 1, 1, True)[3] == 1
    assert graph_key(12, 3, 12, False)[3] == graph_key(3, 3, 3, False)[3] == 4
    assert graph_key(2 * DRAFT_PASS_TOKENS, 2, 2, False)[3] == 2 * DRAFT_PASS_TOKENS


def test_batch_invariant_passes_split_keys_as_one_decode_alone():
    """SPARKINFER_BATCH_INVARIANT: every small pass takes a lone decode's splits, however many
    sequences share it, so those passes need no graph per bucket of sequences."""
    assert {graph_key(n, s, s, False, True)[3] for n in range(1, DRAFT_PASS_TOKENS + 1)
            for s in range(1, n + 1)} == {1}
    assert len(graph_shapes(64, DRAFT_PASS_TOKENS, True)) < \
        len(graph_shapes(64, DRAFT_PASS_TOKENS, False))
