"""ModelBackend: what the engine runs, one contract the CPU model and CudaModel both implement.

The engine reads a backend's limits and capabilities from these attributes and never probes for
methods: a backend that picks tokens on its device says so (picks_on_device, max_sample_top_k), one
that queues several decode passes per call says how many (max_queued_steps), and `prepare`
compiles or captures whatever its passes need before the engine serves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import numpy as np

from sparkinfer_cli.model.batch import SamplingRows, SequenceBatch

if TYPE_CHECKING:
    from sparkinfer_cli.model.config import ModelConfig


class ModelCache(Protocol):
    """The KV blocks and recurrent-state slots a backend's passes read and write."""

    num_blocks: int
    block_size: int
    num_state_slots: int

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None: ...
    def copy_state(self, src_slot: int, dst_slot: int) -> None: ...
    def reset_state(self, slot: int) -> None: ...


CacheT = TypeVar("CacheT", bound=ModelCache)


class NextTokenHead(ABC, Generic[CacheT]):
    """A model's multi-token-prediction head: from the model's normed hidden state at position p
    and the token at p + 1 (placed at position p + 1 of the head's own cache), the logits of the
    token at p + 2 and the head's own hidden state (to draft on from)."""

    @abstractmethod
    def create_cache(self, num_blocks: int, block_size: int) -> CacheT: ...

    @abstractmethod
    def forward(self, hidden: np.ndarray, batch: SequenceBatch,
                cache: CacheT) -> tuple[np.ndarray, np.ndarray]:
        """hidden (N, n_embd): the model's, one row a new token of batch. (logits, hidden) of
        each sequence's last new token."""

    def forward_greedy(self, hidden: np.ndarray, batch: SequenceBatch,
                       cache: CacheT) -> tuple[np.ndarray, np.ndarray]:
        """forward's argmax ids (num_seqs,) (ties: the lowest id) and hidden states; a head on a
        device picks them there, so only the ids come back."""
        logits, states = self.forward(hidden, batch, cache)
        return np.argmax(logits, axis=-1), states

    def prepare(self, cache: CacheT, max_seqs: int, max_pass_tokens: int) -> None:
        """Compiles or captures the head's passes of up to max_seqs sequences and max_pass_tokens
        tokens over cache before the engine serves (nothing to do by default)."""


@dataclass
class StepTimes:
    """Host-side cost of forward passes ("decode": decode passes replayed from a graph; "other":
    the rest, prefills and captures included): `host_s` until the GPU work is queued, `total_s`
    until the logits are on the host."""
    steps: dict[str, int] = field(default_factory=lambda: {"decode": 0, "other": 0})
    host_s: dict[str, float] = field(default_factory=lambda: {"decode": 0.0, "other": 0.0})
    total_s: dict[str, float] = field(default_factory=lambda: {"decode": 0.0, "other": 0.0})

    def add(self, kind: str, host_s: float, total_s: float) -> None:
        self.steps[kind] += 1
        self.host_s[kind] += host_s
        self.total_s[kind] += total_s

    def mean_us(self, kind: str) -> tuple[float, float]:
        n = max(self.steps[kind], 1)
        return self.host_s[kind] / n * 1e6, self.total_s[kind] / n * 1e6


class ModelBackend(ABC, Generic[CacheT]):
    """A model the engine runs, over caches of type CacheT that only it creates."""

    config: ModelConfig
    max_pass_tokens: int = 0  # the most tokens one forward pass takes (0 = no limit)
    max_queued_steps: int = 1  # decode passes decode_greedy queues per call (1 = it has none)
    max_sample_top_k: int = 0  # widest top-k forward_sampled draws exactly (0 = it has none)
    picks_on_device: bool = False  # forward_greedy returns argmax ids picked on the device
    # forward honours batch.logit_counts (a decode's drafts scored in one pass, each row's numbers
    # those of decoding it alone) in passes of at most max_draft_pass_tokens tokens (0 = any)
    scores_drafts: bool = False
    max_draft_pass_tokens: int = 0
    # a hybrid model's pass writes the recurrent state after a decode's checked rows into
    # batch.draft_state_slots; without it the engine copies the state before such a pass and,
    # after a rejection, restores it and runs the kept tokens again
    snapshots_draft_states: bool = False
    # > 0: the engine keeps every pass within this many tokens, where a row's numbers do not
    # depend on the rows beside it (the model's batch-invariant mode); 0: no such limit needed
    invariant_pass_tokens: int = 0
    mtp: NextTokenHead | None = None  # the file's MTP head, where the backend runs it
    times: StepTimes | None = None  # the host's cost of its passes, where the backend counts it

    @abstractmethod
    def create_cache(self, num_blocks: int, block_size: int,
                     num_state_slots: int) -> CacheT: ...

    @abstractmethod
    def forward(self, batch: SequenceBatch, cache: CacheT) -> np.ndarray:
        """Logits (num_seqs, n_vocab) of each sequence's last new token, or (N, n_vocab) of
        every new token when batch.all_logits."""

    def forward_hidden(self, batch: SequenceBatch, cache: CacheT) -> tuple[np.ndarray, np.ndarray]:
        """forward's logits and the normed hidden state of every new token (N, n_embd): what
        the MTP head reads."""
        raise NotImplementedError(f"{type(self).__name__} gives no hidden states")

    def forward_greedy_hidden(self, batch: SequenceBatch,
                              cache: CacheT) -> tuple[np.ndarray, np.ndarray]:
        """forward_greedy's ids and forward_hidden's hidden states of one pass (picks_on_device):
        an MTP head's steps move ids, not logits, off the device."""
        raise NotImplementedError(f"{type(self).__name__} picks no tokens on a device")

    def prepare(self, cache: CacheT, max_seqs: int, max_pass_tokens: int) -> None:
        """Compiles or captures every pass of up to max_seqs sequences and max_pass_tokens
        tokens before the engine serves (nothing to do by default)."""

    def forward_greedy(self, batch: SequenceBatch, cache: CacheT) -> np.ndarray:
        """The argmax ids of forward's rows (one a logit row), picked on the device
        (picks_on_device)."""
        raise NotImplementedError(f"{type(self).__name__} picks no tokens on a device")

    def forward_sampled(self, batch: SequenceBatch, cache: CacheT,
                        rows: SamplingRows | None) -> np.ndarray:
        """(num_seqs,) ids drawn on the device by each sequence's draw (max_sample_top_k > 0)."""
        raise NotImplementedError(f"{type(self).__name__} samples no tokens on a device")

    def decode_greedy(self, batch: SequenceBatch, cache: CacheT,
                      n_steps: int) -> Iterator[np.ndarray]:
        """The argmax ids of n_steps decode passes, each fed the previous pass's ids on the
        device (max_queued_steps > 1)."""
        raise NotImplementedError(f"{type(self).__name__} queues no decode passes")

    def decode_drawn(self, batch: SequenceBatch, cache: CacheT, n_steps: int,
                     draws: Callable[[int], SamplingRows]) -> Iterator[np.ndarray]:
        """decode_greedy's passes with each pass's ids drawn by draws(step) (forward_sampled's
        rows), which is called once the previous pass's ids were read (max_queued_steps > 1,
        max_sample_top_k > 0)."""
        raise NotImplementedError(f"{type(self).__name__} queues no decode passes")
