"""Scheduling policies: which waiting request goes next, how big a prefill piece may be, and how
many prefills share a step.

All four share one schedule(); they differ only here (STYLE rule 3):
- batched:    FIFO; after the decodes, every waiting prompt that fits joins the step, up to
              step_tokens tokens in all; a prompt longer than what is left advances in pieces of
              that size, so running decodes keep streaming. The default.
- continuous: the seed server's rule: FIFO; at most one prefill a step, run whole and joining the
              decodes if small enough (else it waits for them to drain).
- chunked:    as continuous, but prefills always advance in pieces of prefill_chunk_tokens.
- priority:   highest priority first (FIFO among equals); one prefill a step, run alone (decodes
              pause).

Without prefill_batched, continuous and priority prefills also advance in chunks of
prefill_chunk_tokens.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparkinfer_cli.engine.config import EngineConfig
    from sparkinfer_cli.engine.request import Request


class BasePolicy:
    """Ordering of the waiting queue and the size of the step's prefill piece."""

    is_exclusive_prefill = False  # True: a step with a prefill schedules no decodes
    max_prefills_per_step = 1  # the seed server's rule

    def __init__(self, config: EngineConfig):
        self.chunk_tokens = config.prefill_chunk_tokens
        self.mix_max = config.prefill_mix_max  # longest prefill piece that joins decodes
        self.is_chunking = not config.prefill_batched
        self.step_tokens = 0  # tokens a step carries at most, decodes included (0 = the model's)

    def sort_key(self, request: Request) -> tuple[int, ...]:
        return (request.arrival_seq,)

    def prefill_piece(self, num_remaining: int) -> int:
        """Prompt tokens of one request to compute this step: all of them, or one chunk."""
        if self.is_chunking and self.chunk_tokens:
            return min(num_remaining, self.chunk_tokens)
        return num_remaining


class BatchedPolicy(BasePolicy):
    max_prefills_per_step = sys.maxsize

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.step_tokens = config.step_tokens
        # pieces never outgrow step_tokens, so no prompt needs to wait for the decodes to drain
        self.mix_max = 0


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
    "batched": BatchedPolicy, "continuous": ContinuousPolicy, "chunked": ChunkedPolicy,
    "priority": PriorityPolicy,
}


def create_policy(config: EngineConfig) -> BasePolicy:
    return POLICIES[config.sched_policy](config)
