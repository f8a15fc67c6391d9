"""Scheduler: picks each step's work (decodes first, then at most one prefill piece) over ints."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.engine.kv_cache import CacheOps, KVCacheManager
from sparkinfer_cli.engine.policy import BasePolicy
from sparkinfer_cli.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledSequence:
    request_id: str
    token_ids: list[int]  # the tokens whose KV this step computes
    start_position: int  # tokens of the request already in the cache
    block_ids: tuple[int, ...]  # covering start_position + len(token_ids)
    state_slot: int
    needs_logits: bool  # the piece reaches the request's last token: sample from it


@dataclass
class SchedulerOutput:
    sequences: list[ScheduledSequence] = field(default_factory=list)
    cache_ops: CacheOps = field(default_factory=CacheOps)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences and self.cache_ops.is_empty


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, policy: BasePolicy):
        self.config, self.kv, self.policy = config, kv, policy
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._num_scheduled = 0  # sequences scheduled so far: the rotation stamp

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        # Progress model: a request chases num_computed_tokens toward num_tokens. A decode has one
        # token to go, a prefill more. Decodes are packed first (least recently run first) up to
        # max_batch_tokens; then at most one prefill piece joins, sized and ordered by the policy.
        output = SchedulerOutput()
        decodes = self._pick_decodes()
        prefill = self._pick_prefill(len(decodes), output.cache_ops)
        if prefill and self.policy.is_exclusive_prefill:
            decodes = []
        pieces = [(request, 1) for request in decodes] + ([prefill] if prefill else [])
        output.sequences = [self._scheduled(request, n) for request, n in pieces]
        return output

    def update_from_output(self, output: SchedulerOutput) -> None:
        """Marks the step's tokens as computed (call after the forward pass succeeded)."""
        for seq in output.sequences:
            self.requests[seq.request_id].num_computed_tokens += len(seq.token_ids)

    def finish(self, request: Request, reason: str, error: str | None = None) -> None:
        """Ends a request in any state and frees its KV."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        del self.requests[request.request_id]
        if request.kv is not None:
            self.kv.free(request.kv)
            request.kv = None
        request.status, request.finish_reason, request.error = RequestStatus.FINISHED, reason, error
        request.finished_at = time.monotonic()

    def _pick_decodes(self) -> list[Request]:
        decodes = [r for r in self.running if not r.is_prefilling]
        decodes.sort(key=lambda r: (r.last_scheduled, r.arrival_seq))
        return decodes[:self.config.max_batch_tokens]

    def _pick_prefill(self, num_decodes: int, ops: CacheOps) -> tuple[Request, int] | None:
        """The step's one prefill piece: the running partial prefill, else the next admission."""
        exclusive = self.policy.is_exclusive_prefill
        if num_decodes >= self.config.max_batch_tokens and not exclusive:
            return None
        request = next((r for r in self.running if r.is_prefilling), None) or self._next_waiting()
        if request is None:
            return None
        num_computed = request.num_computed_tokens if request.kv else \
            self.kv.num_prefix_hit_tokens(request.prompt_ids)
        piece = self.policy.prefill_piece(request.num_tokens - num_computed)
        mix_max = self.config.prefill_mix_max
        if num_decodes and not exclusive and mix_max and piece > mix_max:
            return None  # NOTE: a long prefill waits for the decodes to drain (ITL spike otherwise)
        if request.kv is None and not self._admit(request, ops):
            return None
        return request, piece

    def _next_waiting(self) -> Request | None:
        return min(self.waiting, key=self.policy.sort_key, default=None)

    def _admit(self, request: Request, ops: CacheOps) -> bool:
        """Moves the request to running if a sequence slot and its KV are free now."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        allocation = self.kv.allocate(request.prompt_ids, request.num_kv_tokens)
        if allocation is None:
            return False
        request.kv, request_ops = allocation
        ops.extend(request_ops)
        request.num_computed_tokens = request.kv.num_cached_tokens
        request.status, request.scheduled_at = RequestStatus.RUNNING, time.monotonic()
        self.waiting.remove(request)
        self.running.append(request)
        return True

    def _scheduled(self, request: Request, num_new: int) -> ScheduledSequence:
        assert request.kv is not None
        self._num_scheduled += 1
        request.last_scheduled = self._num_scheduled
        start = request.num_computed_tokens
        end = start + num_new
        return ScheduledSequence(request.request_id, request.token_ids[start:end], start,
                                 request.kv.block_ids[:self.kv.num_blocks_for(end)],
                                 request.kv.state_slot, end == request.num_tokens)
