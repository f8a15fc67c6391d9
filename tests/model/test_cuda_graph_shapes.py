"""The passes CudaModel.prepare captures before serving cover every pass the engine forms."""

from __future__ import annotations

import pytest

from sparkinfer_cli.backend.cuda.model import (
    MAX_GRAPH_ROWS,
    graph_shapes,
    logit_bucket,
)
from sparkinfer_cli.backend.cuda.workspace import row_bucket


def _key(n_tokens: int, n_seqs: int) -> tuple[int, bool, int]:
    """CudaModel._pass's graph key (row bucket, several tokens a sequence, logit rows) of a pass
    of n_tokens tokens over n_seqs sequences."""
    multi_token, n_rows = n_tokens > n_seqs, row_bucket(n_tokens)
    return n_rows, multi_token, logit_bucket(n_seqs, n_rows, multi_token)


@pytest.mark.parametrize("max_seqs, max_pass_tokens", [(64, 2048), (24, 300), (4, 4096), (1, 16)])
def test_graph_shapes_cover_every_pass_of_the_engine(max_seqs, max_pass_tokens):
    reachable = {_key(n_tokens, n_seqs) for n_seqs in range(1, max_seqs + 1)
                 for n_tokens in range(n_seqs, max_pass_tokens + 1)
                 if n_tokens > n_seqs or n_seqs <= MAX_GRAPH_ROWS}
    shapes = graph_shapes(max_seqs, max_pass_tokens)
    assert all(n_seqs <= min(max_seqs, n_tokens) for n_tokens, n_seqs in shapes)
    captured = [_key(*shape) for shape in shapes]
    assert len(captured) == len(set(captured))  # one pass a key
    assert set(captured) >= reachable
    assert all(logits <= rows <= row_bucket(max_pass_tokens) for rows, _, logits in captured)
