"""What the engine hands a model for one forward pass, and the caches the model reads and writes.

A forward pass runs any mix of sequences, each with some new tokens (a whole prompt, a prompt
chunk, or one decode token). KV lives in a paged pool: a sequence owns a list of blocks (its block
table); token at position p of the sequence sits in block `block_table[p // block_size]`, slot
`p % block_size`. Hybrid (Gated-DeltaNet) models also keep one recurrent-state slot per sequence.
The engine decides which blocks and slots a sequence owns (pure Python ints); the model only reads
and writes them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True)
class SequenceSpan:
    start: int  # tokens already in the cache
    lo: int  # this sequence's new tokens are token_ids[lo:hi]
    hi: int
    block_table: np.ndarray
    state_slot: int
    # slots that take the recurrent state after each of the rows hi − 1 − len(...) .. hi − 2 (a
    # decode's fed token and all but its last draft: SequenceBatch.draft_state_slots)
    draft_state_slots: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        """Sequence length after this pass."""
        return self.start + self.hi - self.lo


@dataclass
class SequenceBatch:
    token_ids: np.ndarray  # (N,) int32: the new tokens of every sequence, concatenated
    start_positions: list[int]  # per sequence: tokens already in its cache
    num_new_tokens: list[int]  # per sequence: how many of token_ids are its own
    block_tables: list[np.ndarray]  # per sequence: int32 block ids covering start + new tokens
    state_slots: list[int] = field(default_factory=list)  # per sequence (hybrid models only)
    all_logits: bool = False  # True: logits of every new token; False: last token of each sequence
    # per sequence: logits of its last this-many new tokens (drafts to verify); empty: 1 each
    logit_counts: list[int] = field(default_factory=list)
    # per sequence (hybrid models that snapshot_draft_states): the slots that take its recurrent
    # state after each checked row but the last (the state after the fed token and after each
    # draft), so that a rejected draft's sequence goes on from the state at the last kept token;
    # empty: none
    draft_state_slots: list[tuple[int, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.start_positions) != len(self.num_new_tokens) or \
                len(self.block_tables) != len(self.num_new_tokens):
            raise ValueError("per-sequence lists of a SequenceBatch differ in length")
        if sum(self.num_new_tokens) != len(self.token_ids):
            raise ValueError("num_new_tokens does not add up to len(token_ids)")

    @property
    def num_seqs(self) -> int:
        return len(self.num_new_tokens)

    def token_offsets(self) -> np.ndarray:
        """(num_seqs + 1,) start index of each sequence's tokens in token_ids."""
        return np.concatenate([[0], np.cumsum(self.num_new_tokens)]).astype(np.int64)

    def positions(self) -> np.ndarray:
        """(N,) absolute position of every new token."""
        return np.concatenate([np.arange(s, s + n) for s, n in
                               zip(self.start_positions, self.num_new_tokens)]).astype(np.int32)

    def spans(self) -> list[SequenceSpan]:
        """Where each sequence's new tokens sit in token_ids, with its cache coordinates."""
        offsets = self.token_offsets()
        slots = self.state_slots or [0] * self.num_seqs
        drafts = self.draft_state_slots or [()] * self.num_seqs
        return [SequenceSpan(self.start_positions[i], int(offsets[i]), int(offsets[i + 1]),
                             self.block_tables[i], slots[i], drafts[i])
                for i in range(self.num_seqs)]

    def logit_rows(self) -> np.ndarray:
        """Indices into token_ids of the rows whose logits the caller wants."""
        if self.all_logits:
            return np.arange(len(self.token_ids))
        ends = self.token_offsets()[1:]
        if not self.logit_counts:
            return ends - 1
        return np.concatenate([np.arange(end - n, end) for end, n in zip(ends, self.logit_counts)])

    @property
    def is_decode(self) -> bool:
        """One new token per sequence: a pass a CUDA decode graph replays."""
        return all(n == 1 for n in self.num_new_tokens)

    def next_decode_step(self, token_ids: np.ndarray) -> SequenceBatch:
        """The decode pass after this one: every sequence one position on, new tokens token_ids."""
        return SequenceBatch(np.asarray(token_ids, dtype=np.int32),
                             [s + 1 for s in self.start_positions], self.num_new_tokens,
                             self.block_tables, self.state_slots, self.all_logits)

    @classmethod
    def single(cls, token_ids: np.ndarray, start: int, block_table: np.ndarray, state_slot: int = 0,
               all_logits: bool = False) -> SequenceBatch:
        ids = np.asarray(token_ids, dtype=np.int32)
        return cls(ids, [start], [len(ids)], [np.asarray(block_table, dtype=np.int32)],
                   [state_slot], all_logits)


class DeviceDraw(NamedTuple):
    """How an on-device sampler picks one sequence's token (kernels/cuda/sampling.py): the host
    Sampler's truncation and draw for this uniform u; temperature 0 = the argmax."""

    temperature: float
    top_k: int  # 0: the whole vocabulary
    top_p: float
    min_p: float
    uniform: float  # u in [0, 1)


ARGMAX = DeviceDraw(0.0, 0, 1.0, 0.0, 0.0)
ALL_ALLOWED = np.uint32(0xFFFFFFFF)  # a mask word that refuses none of its 32 tokens


def mask_words(n_vocab: int) -> int:
    """u32 words of a mask of allowed tokens: bit j of word w is token 32w + j (llguidance's
    bitmask read as little-endian words)."""
    return -(-n_vocab // 32)


@dataclass(frozen=True)
class SamplingRows:
    """A pass's DeviceDraw per sequence, as columns (what the device copies), and the tokens a
    structured answer's grammar allows each sequence (None: every token, on every row)."""

    temperature: np.ndarray  # (n,) float32
    top_k: np.ndarray  # (n,) int32
    top_p: np.ndarray  # (n,) float32
    min_p: np.ndarray  # (n,) float32
    uniform: np.ndarray  # (n,) float32
    allowed: np.ndarray | None = None  # (n, mask_words(n_vocab)) uint32

    @classmethod
    def of(cls, draws: Sequence[DeviceDraw],
           masks: Sequence[np.ndarray | None] | None = None) -> SamplingRows:
        """masks: per draw, its uint32 mask words or None (every token)."""
        t, k, p, m, u = zip(*draws) if draws else ((),) * 5
        return cls(np.array(t, np.float32), np.array(k, np.int32), np.array(p, np.float32),
                   np.array(m, np.float32), np.array(u, np.float32), _stacked(masks))

    def __len__(self) -> int:
        return len(self.temperature)

    def __iter__(self) -> Iterator[DeviceDraw]:
        for values in zip(self.temperature, self.top_k, self.top_p, self.min_p, self.uniform):
            yield DeviceDraw(*values)

    def spread(self, n: int, at: Sequence[int]) -> SamplingRows:
        """Rows for n sequences: these at positions `at`, the argmax over every token at the
        others."""
        draws: list[DeviceDraw] = [ARGMAX] * n
        masks: list[np.ndarray | None] = [None] * n
        for j, (i, draw) in enumerate(zip(at, self)):
            draws[i] = draw
            masks[i] = None if self.allowed is None else self.allowed[j]
        return SamplingRows.of(draws, masks)


def _stacked(masks: Sequence[np.ndarray | None] | None) -> np.ndarray | None:
    """The rows' masks as one (n, words) array, every token allowed where a row has none; None
    when no row has one."""
    if masks is None or all(m is None for m in masks):
        return None
    words = next(len(m) for m in masks if m is not None)
    out = np.full((len(masks), words), ALL_ALLOWED, np.uint32)
    for i, m in enumerate(masks):
        if m is not None:
            out[i] = m
    return out
