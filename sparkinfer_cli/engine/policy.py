"""Scheduling policies: which waiting request goes next, and how big a prefill piece may be.

All three share one schedule(); they differ only here (STYLE rule 3):
- continuous: FIFO; prefills run whole and join the decodes if small enough.
- chunked:    FIFO; prefills always advance in pieces of prefill_chunk_tokens beside the decodes.
- priority:   highest priority first (FIFO among equals); prefills run alone (decodes pause).

A step carries at most one prefill piece (the seed server's rule). Without prefill_batched,
continuous and priority prefills also advance in chunks of prefill_chunk_tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparkinfer_cli.engine.config import EngineConfig
    from sparkinfer_cli.engine.request import Request


class BasePolicy:
    """Ordering of the waiting queue and the size of the step's prefill piece."""

    is_exclusive_prefill = False  # True: a step with a prefill schedules no decodes

    def __init__(self, config: EngineConfig):
        self.chunk_tokens = config.prefill_chunk_tokens
        self.mix_max = config.prefill_mix_max
        self.is_chunking = not config.prefill_batched

    def sort_key(self, request: Request) -> tuple[int, ...]:
        return (request.arrival_seq,)

    def prefill_piece(self, num_remaining: int) -> int:
        """Prompt tokens of one request to compute this step: all of them, or one chunk."""
        if self.is_chunking and self.chunk_tokens:
            return min(num_remaining, self.chunk_tokens)
        return num_remaining


class ContinuousPolicy(BasePolicy):
    pass


class ChunkedPolicy(BasePolicy):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.is_chunking = True


class PriorityPolicy(BasePolicy):
    is_exclusive_prefill = True

    def sort_key(self, request: Request) -> tuple[int, ...]:
        return (-request.priority, request.arrival_seq)


POLICIES: dict[str, type[BasePolicy]] = {
    "continuous": ContinuousPolicy, "chunked": ChunkedPolicy, "priority": PriorityPolicy,
}


def create_policy(config: EngineConfig) -> BasePolicy:
    return POLICIES[config.sched_policy](config)
