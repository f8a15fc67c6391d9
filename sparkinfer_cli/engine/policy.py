"""Scheduling policies: which waiting request goes next, and how big a prefill piece may be.

All three share one schedule(); they differ only here (STYLE rule 3):
- continuous: FIFO; prefills run whole (batched) and join the decodes if small enough.
- chunked:    FIFO; prefills always advance in pieces of prefill_chunk_tokens beside the decodes.
- priority:   highest priority first (FIFO among equals); a prefill runs alone (decodes pause).
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
        self.is_batched = config.prefill_batched

    def sort_key(self, request: Request) -> tuple[int, ...]:
        return (request.arrival_seq,)

    def prefill_piece(self, num_remaining: int) -> int:
        """Prompt tokens to compute this step: all of them as one batched pass, or one chunk."""
        return num_remaining if self.is_batched else self._chunk(num_remaining)

    def _chunk(self, num_remaining: int) -> int:
        return min(num_remaining, self.chunk_tokens) if self.chunk_tokens else num_remaining


class ContinuousPolicy(BasePolicy):
    pass


class ChunkedPolicy(BasePolicy):
    def prefill_piece(self, num_remaining: int) -> int:
        return self._chunk(num_remaining)


class PriorityPolicy(BasePolicy):
    is_exclusive_prefill = True

    def sort_key(self, request: Request) -> tuple[int, ...]:
        return (-request.priority, request.arrival_seq)


POLICIES: dict[str, type[BasePolicy]] = {
    "continuous": ContinuousPolicy, "chunked": ChunkedPolicy, "priority": PriorityPolicy,
}


def create_policy(config: EngineConfig) -> BasePolicy:
    return POLICIES[config.sched_policy](config)
