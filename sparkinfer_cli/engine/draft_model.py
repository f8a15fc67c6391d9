"""Drafts from a second, smaller model of the same vocabulary (speculative decoding's draft-model
source, llama.cpp's --model-draft): at each decode step the draft model continues every drafting
request greedily for as many tokens as the request may draft, and the target checks them as it
checks n-gram drafts (speculative.py), so the output stays exactly the target's.

The draft model's KV lives in a cache of its own laid out like the target's (same blocks, same
block size), indexed by the target request's block table: the request already owns those blocks
for every position its drafts can reach, so the draft model needs no allocator. A request's
draft KV is valid up to `DraftLength.draft_kv_tokens` of its tokens; each step feeds the tokens
after that (the whole prompt at its first decode step, then the fed token and the drafts the
target kept), so a rejected draft's KV is simply overwritten. Blocks the prefix cache shares
between requests hold the same tokens at the same positions, so a request that recomputes their
draft KV writes what is there already.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sparkinfer_cli.engine.request import Request
from sparkinfer_cli.engine.speculative import DRAFTER_PASS_TOKENS, Drafter
from sparkinfer_cli.model.backend import ModelBackend, ModelCache
from sparkinfer_cli.model.batch import SequenceBatch


class DraftModel(Drafter):
    def __init__(self, model: ModelBackend, num_blocks: int, block_size: int):
        if model.config.is_hybrid:  # a recurrent state cannot be rewound to a rejected draft
            raise ValueError("a draft model must have attention layers only (Qwen3, Qwen2, "
                             "Llama); this one keeps a recurrent state")
        self.model = model
        self.cache = model.create_cache(num_blocks, block_size, 0)

    def prepare(self, max_seqs: int, max_pass_tokens: int) -> None:
        self.model.prepare(self.cache, max_seqs, max_pass_tokens)

    @property
    def caches(self) -> list[ModelCache]:
        return [self.cache]

    def drafts(self, wants: Sequence[tuple[Request, int]], step_room: int) -> list[list[int]]:
        """Each request's next `limit` tokens as the draft model decodes them greedily, within
        step_room drafted tokens in all (earlier requests first)."""
        limits = []
        for _, limit in wants:
            limits.append(min(limit, max(step_room, 0)))
            step_room -= limits[-1]
        active = [(request, k) for (request, _), k in zip(wants, limits) if k > 0]
        drafted = dict(zip((id(r) for r, _ in active), self._catch_up([r for r, _ in active])))
        for step in range(1, max((k for _, k in active), default=0)):
            going = [request for request, k in active if k > step]
            batch = _batch([([drafted[id(r)][-1]], r.num_tokens + step - 1, r) for r in going])
            for request, token in zip(going, self._greedy(batch)):
                drafted[id(request)].append(token)
        for request, _ in active:
            assert request.drafting is not None
            request.drafting.draft_kv_tokens = request.num_tokens
        return [drafted.get(id(request), []) if k else [] for (request, _), k in zip(wants, limits)]

    def _catch_up(self, requests: list[Request]) -> list[list[int]]:
        """Feeds each request's tokens whose draft KV is not written yet (at least its last one),
        in passes of at most DRAFTER_PASS_TOKENS (and the model's max_pass_tokens); returns [the
        token after them]."""
        todo = {}
        for request in requests:
            assert request.drafting is not None
            todo[id(request)] = min(request.drafting.draft_kv_tokens, request.num_tokens - 1)
        picked: dict[int, int] = {}
        while any(todo[id(r)] < r.num_tokens for r in requests):
            room = min(self.model.max_pass_tokens or DRAFTER_PASS_TOKENS, DRAFTER_PASS_TOKENS)
            pieces = []
            for request in requests:
                start = todo[id(request)]
                n = min(request.num_tokens - start, room)
                if n > 0:
                    pieces.append((request.token_ids[start:start + n], start, request))
                    todo[id(request)], room = start + n, room - n
            for (_, _, request), token in zip(pieces, self._greedy(_batch(pieces))):
                if todo[id(request)] == request.num_tokens:
                    picked[id(request)] = token
        return [[picked[id(request)]] for request in requests]

    def _greedy(self, batch: SequenceBatch) -> list[int]:
        """The argmax after each sequence's last new token."""
        if self.model.picks_on_device:
            return [int(t) for t in self.model.forward_greedy(batch, self.cache)]
        return [int(t) for t in np.argmax(self.model.forward(batch, self.cache), axis=-1)]


def _batch(pieces: Sequence[tuple[Sequence[int], int, Request]]) -> SequenceBatch:
    """A pass feeding each (tokens, start position, request) through the request's blocks."""
    tables = []
    for _, _, request in pieces:
        assert request.kv is not None
        tables.append(np.asarray(request.kv.block_ids, dtype=np.int32))
    return SequenceBatch(
        token_ids=np.fromiter((t for tokens, _, _ in pieces for t in tokens), dtype=np.int32),
        start_positions=[start for _, start, _ in pieces],
        num_new_tokens=[len(tokens) for tokens, _, _ in pieces],
        block_tables=tables, state_slots=[], logit_counts=[])
