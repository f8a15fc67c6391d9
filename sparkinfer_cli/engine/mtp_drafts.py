"""Drafts from the model's own multi-token-prediction head (Qwen3.5 / Qwen3.6 files with NextN
blocks; llama.cpp's --spec-type draft-mtp): the head reads the model's normed hidden state at
position p and the token at p + 1, and predicts the token at p + 2.

The engine keeps each drafting request's hidden states as its passes compute them
(DraftLength.hidden). At a decode step the head first takes every pair it has not seen, up to
(hidden at n − 2, token n − 1) for a request of n tokens, whose prediction is the first draft; it
then drafts on from its own hidden state and argmax token. Its KV lives in a cache laid out like
the model's and indexed by the request's block table (as draft_model.py's); positions from n on
hold drafts and are rewritten by the next step's pairs. A request whose hidden states have a gap
(its prompt came from the prefix cache, or its logprobs were scored) takes the pairs from the
first state it has; the head's KV of the positions before that is whatever the shared blocks
hold (the prefix cache's block copies reach this cache too), which at worst makes its drafts
worse, never the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from sparkinfer_cli.engine.request import Request
from sparkinfer_cli.engine.speculative import DRAFTER_PASS_TOKENS, Drafter
from sparkinfer_cli.model.backend import ModelCache, NextTokenHead
from sparkinfer_cli.model.batch import SequenceBatch


class Piece(NamedTuple):
    """Pairs the head takes in one pass: tokens at positions first, first + 1, ..., each with
    the hidden state of the position before it."""
    first: int
    tokens: list[int]
    hidden: np.ndarray  # (len(tokens), n_embd)


class MtpDrafter(Drafter):
    def __init__(self, head: NextTokenHead, num_blocks: int, block_size: int):
        self.head = head
        self.cache = head.create_cache(num_blocks, block_size)

    def prepare(self, max_seqs: int, max_pass_tokens: int) -> None:
        self.head.prepare(self.cache, max_seqs, min(max_pass_tokens, DRAFTER_PASS_TOKENS))

    @property
    def caches(self) -> list[ModelCache]:
        return [self.cache]

    def drafts(self, wants: Sequence[tuple[Request, int]], step_room: int) -> list[list[int]]:
        pieces: dict[int, Piece] = {}  # by id(request): the next pairs the head takes
        limits = []
        for request, limit in wants:
            pairs = self._unseen_pairs(request) if limit > 0 and step_room > 0 else None
            limits.append(0 if pairs is None else min(limit, step_room))
            if pairs is not None:
                pieces[id(request)] = self._take_leading_pairs(request, pairs)
            step_room -= limits[-1]
        active = [(request, k) for (request, _), k in zip(wants, limits) if k]
        drafted: dict[int, list[int]] = {id(request): [] for request, _ in active}
        for step in range(max((k for _, k in active), default=0)):
            going = [request for request, k in active if k > step]
            ids, hidden = self._forward(going, [pieces[id(r)] for r in going])
            for request, picked, h in zip(going, ids, hidden):
                token = int(picked)
                drafted[id(request)].append(token)
                pieces[id(request)] = Piece(request.num_tokens + step, [token], h[None])
        for request, _ in active:
            assert request.drafting is not None
            request.drafting.draft_kv_tokens = request.num_tokens
            request.drafting.hidden.drop_before(request.num_tokens - 1)
        return [drafted.get(id(request), []) for request, _ in wants]

    def _take_leading_pairs(self, request: Request, piece: Piece) -> Piece:
        """Feeds the head all but the last DRAFTER_PASS_TOKENS of the piece's pairs, a pass of
        at most that many at a time; returns the rest."""
        while len(piece.tokens) > DRAFTER_PASS_TOKENS:
            n = min(DRAFTER_PASS_TOKENS, len(piece.tokens) - DRAFTER_PASS_TOKENS)
            self._forward([request], [Piece(piece.first, piece.tokens[:n], piece.hidden[:n])])
            piece = Piece(piece.first + n, piece.tokens[n:], piece.hidden[n:])
        return piece

    @staticmethod
    def _unseen_pairs(request: Request) -> Piece | None:
        """(first position, tokens, hidden rows) of the pairs the head has not taken, up to the
        one at the request's last token; None when the hidden state before that is missing."""
        assert request.drafting is not None
        n, hidden = request.num_tokens, request.drafting.hidden
        first = max(request.drafting.draft_kv_tokens, hidden.start + 1 if hidden.start else 0)
        rows = hidden.take(first - 1, n - 1) if first else hidden.take(0, n - 1)
        if rows is None or first >= n:
            return None
        if not first:  # the first token pairs with zeros
            rows = np.concatenate([np.zeros_like(rows[:1]), rows])
        return Piece(first, request.token_ids[first:n], rows)

    def _forward(self, requests: list[Request],
                 pieces: list[Piece]) -> tuple[np.ndarray, np.ndarray]:
        """The head over each request's piece: the argmax id and hidden state of its last
        pair."""
        tables = []
        for request in requests:
            assert request.kv is not None
            tables.append(np.asarray(request.kv.block_ids, dtype=np.int32))
        batch = SequenceBatch(
            token_ids=np.fromiter((t for p in pieces for t in p.tokens), np.int32),
            start_positions=[p.first for p in pieces],
            num_new_tokens=[len(p.tokens) for p in pieces], block_tables=tables,
            state_slots=[], logit_counts=[])
        hidden = np.concatenate([p.hidden for p in pieces]).astype(np.float32, copy=False)
        return self.head.forward_greedy(hidden, batch, self.cache)
