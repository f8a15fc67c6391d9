"""Speculative decoding: a decode step may carry a few guessed tokens (drafts), which the model
checks in the same pass. Drafts come from a Drafter: n-gram prompt lookup here (NgramDrafter), or
a smaller model of the same vocabulary (draft_model.DraftModel). For a greedy request the greedy
token of each checked row decides how many are kept, so the output is exactly what
one-token-at-a-time greedy decoding gives; for a sampled one, speculative sampling
(truncation.check_draft) keeps each draft with its probability, so the output is distributed
exactly as without drafts.

An n-gram draft is what followed the latest earlier occurrence of the sequence's last n tokens
(n from MAX_NGRAM down to 1): cheap, and right often where an answer repeats its prompt (code
edits, retrieval, quoting).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sparkinfer_cli.engine.draft_budget import REQUEST_FADE, Acceptance

if TYPE_CHECKING:
    from sparkinfer_cli.engine.request import Request
    from sparkinfer_cli.engine.sampler import Sampler
    from sparkinfer_cli.model.backend import ModelCache

MAX_NGRAM = 3
# a draft model's or MTP head's pass takes at most this many tokens (a long prompt's catch-up
# runs in pieces, between which nothing else waits longer than one piece)
DRAFTER_PASS_TOKENS = 512
# A draft that keeps failing costs each step its checked rows for nothing (a CPU pass of k + 1 rows
# costs about (k + 3) / 3 single ones): after MISSES_TO_PAUSE checks in a row that keep no draft,
# a request stops drafting for a pause that doubles each time, up to MAX_PAUSE_TOKENS tokens. A
# pause counts tokens, not steps: a step of queued decode passes (CUDA) decodes several
MISSES_TO_PAUSE = 2
FIRST_PAUSE_TOKENS = 4
MAX_PAUSE_TOKENS = 64


def ngram_draft(token_ids: Sequence[int] | np.ndarray, max_drafts: int) -> list[int]:
    """Up to max_drafts tokens that followed the latest earlier occurrence of token_ids' last n
    tokens, for the longest n ≤ MAX_NGRAM that occurs; [] when none does."""
    if max_drafts < 1:
        return []
    ids = np.asarray(token_ids)  # (L,): an array as given (TokenArray), no copy
    length = len(ids)
    for n in range(min(MAX_NGRAM, length - 1), 0, -1):
        starts = np.ones(length - n, dtype=bool)  # windows ids[i:i + n], i < length - n
        for j in range(n):
            starts &= ids[j:length - n + j] == ids[length - n + j]
        found = np.flatnonzero(starts)
        if found.size:
            follow = int(found[-1]) + n
            return ids[follow:follow + max_drafts].tolist()
    return []


class Drafter(ABC):
    """Where a decode step's drafts come from."""

    @abstractmethod
    def drafts(self, wants: Sequence[tuple[Request, int]], step_room: int) -> list[list[int]]:
        """Drafts for each (decoding request, the most it may draft now), in order, within
        step_room drafted tokens in all (earlier requests first)."""

    def prepare(self, max_seqs: int, max_pass_tokens: int) -> None:
        """Compiles what the drafter's passes need before the engine serves."""

    @property
    def caches(self) -> list[ModelCache]:
        """Its caches laid out like the model's, which take the prefix cache's block copies."""
        return []


class NgramDrafter(Drafter):
    def drafts(self, wants: Sequence[tuple[Request, int]], step_room: int) -> list[list[int]]:
        found = []
        for request, limit in wants:
            most = min(limit, step_room)
            found.append(ngram_draft(request.drafting.ids.view(request.token_ids), most)
                         if most > 0 and request.drafting is not None else [])
            step_room -= len(found[-1])
        return found


def sampled_drafts(sampler: Sampler, rows: np.ndarray, drafts: Sequence[int]
                   ) -> tuple[int, int | None]:
    """A sampled request's check: (drafts kept, the token drawn instead of the first one not
    kept, or None when all were kept and the next token is sampled from the last row as usual).
    rows (1 + drafts, n_vocab): the logits after the fed token and after each draft."""
    for i, draft in enumerate(drafts):
        token, kept = sampler.check_draft(rows[i], draft)
        if not kept:
            return i, token
    return len(drafts), None


def accepted_drafts(drafts: Sequence[int], greedy: Sequence[int | None]) -> int:
    """How many drafts the checked rows confirm: greedy[i] is the model's pick after the fed
    token and drafts[:i]; the first mismatch ends the run."""
    for i, draft in enumerate(drafts):
        if greedy[i] != draft:
            return i
    return len(drafts)


class TokenArray:
    """A growing token list's ids as an int32 array, extended by the tokens added since the last
    view: ngram_draft then scans the array without converting the whole list every step (that
    conversion cost a step about a millisecond at 32k tokens)."""

    def __init__(self):
        self._ids = np.empty(0, np.int32)
        self._n = 0  # leading ids copied

    def view(self, token_ids: Sequence[int]) -> np.ndarray:
        """(len(token_ids),) int32: token_ids, which may only have grown since the last view."""
        n = len(token_ids)
        if n < self._n:  # not the list this array followed: start over
            self._n = 0
        if n > self._ids.size:
            grown = np.empty(max(n, 2 * self._ids.size), np.int32)
            grown[:self._n] = self._ids[:self._n]
            self._ids = grown
        self._ids[self._n:n] = token_ids[self._n:n]
        self._n = n
        return self._ids[:n]


class HiddenRows:
    """A request's normed hidden states (the model's, as its passes computed them) at positions
    [start, end): what its MTP head reads. A pass's rows replace those from the pass's first
    position on (a restored hybrid sequence recomputes some); a gap starts the rows afresh. Kept
    as the passes' own pieces (copies), joined only when taken, so a long prompt's pieces are
    not copied again at every piece."""

    def __init__(self) -> None:
        self.start = 0
        self._pieces: list[np.ndarray] = []  # consecutive (rows, n_embd) pieces from start

    @property
    def end(self) -> int:
        return self.start + sum(len(p) for p in self._pieces)

    def put(self, start: int, rows: np.ndarray) -> None:
        if not self._pieces or not self.start <= start <= self.end:
            self.start, self._pieces = start, []
        else:
            self._keep_below(start)
        self._pieces.append(np.array(rows, dtype=np.float32))  # a copy: not a view of the pass

    def take(self, lo: int, hi: int) -> np.ndarray | None:
        """The rows of positions [lo, hi), or None unless all are here."""
        if not self._pieces or lo < self.start or hi > self.end:
            return None
        return np.concatenate(self._pieces)[lo - self.start:hi - self.start]

    def drop_before(self, position: int) -> None:
        while self._pieces and self.start + len(self._pieces[0]) <= position:
            self.start += len(self._pieces.pop(0))
        if self._pieces and position > self.start:
            self._pieces[0] = self._pieces[0][position - self.start:]
            self.start = position

    def _keep_below(self, position: int) -> None:
        """Drops the rows of positions from position on."""
        kept, at = [], self.start
        for piece in self._pieces:
            keep = min(len(piece), max(position - at, 0))
            if keep:
                kept.append(piece[:keep])
            at += len(piece)
        self._pieces = kept


class DraftLength:
    """How many tokens a request drafts at its next decode step: the configured most at first,
    then one more than its last check kept (a copied span tends to go on; a short one, to stop),
    and none for a while once checks keep failing (free prose that repeats nothing), so that
    speculation costs little where it does not pay. Within that, the engine's DraftBudget
    decides by what a row costs and how often this request's drafts are kept (acceptance)."""

    def __init__(self, most: int):
        self.most = most
        self.ids = TokenArray()  # the request's tokens, for ngram_draft
        self.draft_kv_tokens = 0  # its leading positions whose KV a draft model (or head) wrote
        self.hidden = HiddenRows()  # for an MTP head
        self.acceptance = Acceptance()
        self._next = most
        self._misses = 0  # checks in a row that kept no draft
        self._pause = 0  # tokens to decode without drafts, from the next limit() on
        self._resume_at = 0  # the request's token count from which it drafts again
        self._next_pause = FIRST_PAUSE_TOKENS

    def limit(self, num_tokens: int) -> int:
        """The drafts this decode step may carry, the request holding num_tokens tokens (called
        once a decode step)."""
        self.acceptance.fade(REQUEST_FADE)
        if self._pause:
            self._resume_at, self._pause = num_tokens + self._pause, 0
        return 0 if num_tokens < self._resume_at else self._next

    def paused_tokens(self, num_tokens: int) -> int:
        """Tokens the request decodes without drafts from num_tokens on (0: it drafts)."""
        return max(self._resume_at - num_tokens, 0)

    def checked(self, drafted: int, kept: int) -> None:
        """A step's check kept `kept` of its `drafted` tokens."""
        self.acceptance.checked(drafted, kept)
        self._next = min(self.most, kept + 1)
        if kept:
            self._misses, self._next_pause = 0, FIRST_PAUSE_TOKENS
            return
        self._misses += 1
        if self._misses >= MISSES_TO_PAUSE:
            self._misses, self._pause = 0, self._next_pause
            self._next_pause = min(2 * self._next_pause, MAX_PAUSE_TOKENS)


@dataclass
class SpeculationStats:
    """Cumulative over an engine's life (vLLM's spec_decode counters): checks that carried drafts,
    the tokens drafted, and those the checks kept."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, drafted: int, kept: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += kept

    def since(self, earlier: SpeculationStats) -> SpeculationStats:
        """What was counted after `earlier` (a copy of these stats taken then)."""
        return SpeculationStats(self.num_drafts - earlier.num_drafts,
                                self.num_draft_tokens - earlier.num_draft_tokens,
                                self.num_accepted_tokens - earlier.num_accepted_tokens)

    @property
    def acceptance_rate(self) -> float:
        """The share of drafted tokens kept."""
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a check gives on average: the kept drafts plus the model's own next token."""
        return 1 + self.num_accepted_tokens / max(self.num_drafts, 1)
