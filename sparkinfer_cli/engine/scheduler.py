"""Scheduler: picks each step's work over ints, decodes first, then prefills in queue order."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field

from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.engine.draft_budget import DraftBudget
from sparkinfer_cli.engine.kv_cache import (
    CacheOps,
    KVCacheManager,
    SequenceProgress,
)
from sparkinfer_cli.engine.policy import BasePolicy
from sparkinfer_cli.engine.request import Request, RequestStatus
from sparkinfer_cli.engine.speculative import Drafter, NgramDrafter

log = logging.getLogger(__name__)

# a prompt whose logprobs are asked for computes every token's logits: pieces of at most this many
# tokens bound the (piece, n_vocab) array
PROMPT_LOGITS_PIECE = 512


@dataclass(frozen=True)
class ScheduledSequence:
    request_id: str
    token_ids: list[int]  # the tokens whose KV this step computes
    start_position: int  # tokens of the request already in the cache
    block_ids: tuple[int, ...]  # covering start_position + len(token_ids)
    state_slot: int
    needs_logits: bool  # the piece reaches the request's last token: sample from it
    needs_all_logits: bool = False  # every token's logits (its prompt's logprobs are asked for)
    num_drafts: int = 0  # trailing token_ids guessed (speculative): their rows are checked too
    # a hybrid model's slots for the state after each checked row but the last (SequenceBatch)
    draft_state_slots: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    sequences: list[ScheduledSequence] = field(default_factory=list)
    cache_ops: CacheOps = field(default_factory=CacheOps)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def needs_all_logits(self) -> bool:
        """A prompt whose logprobs are asked for: the step carries it alone."""
        return any(s.needs_all_logits for s in self.sequences)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence computes one token: the pass a CUDA decode graph replays."""
        return all(len(s.token_ids) == 1 for s in self.sequences)

    @property
    def is_decoding(self) -> bool:
        """Every sequence decodes one token, with or without drafts: the passes DraftBudget
        weighs against each other."""
        return bool(self.sequences) and all(len(s.token_ids) - s.num_drafts == 1 and
                                            s.needs_logits for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences and self.cache_ops.is_empty


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, policy: BasePolicy,
                 max_step_tokens: int = 0, max_draft_step_tokens: int = 0,
                 drafter: Drafter | None = None, budget: DraftBudget | None = None):
        """max_step_tokens: the most tokens the model takes in one forward pass;
        max_draft_step_tokens: the most a pass that checks drafts may carry (0 = no limit);
        drafter: where drafts come from (n-gram prompt lookup by default); budget: how many
        drafts each request carries in a step (None: as many as its DraftLength allows)."""
        self.config, self.kv, self.policy = config, kv, policy
        self.max_step_tokens = max_step_tokens
        self.max_draft_step_tokens = max_draft_step_tokens
        self.drafter = drafter or NgramDrafter()
        self.budget = budget
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._num_scheduled = 0  # sequences scheduled so far: the rotation stamp
        self._draft_state_slots: list[int] = []  # the last step's (free again at the next)

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
        # max_batch_tokens; then prefill pieces join in queue order (running partial prefills
        # first, then admissions in policy order) as far as the policy and the step's room allow.
        output = SchedulerOutput(cache_ops=self.kv.take_pending_ops())
        # NOTE: the copies out of the last step's draft states run before this step's pass
        self.kv.free_draft_state_slots(self._draft_state_slots)
        self._draft_state_slots = []
        decodes = self._pick_decodes()
        prefills = self._pick_prefills(sum(map(self._num_uncomputed, decodes)),
                                       output.cache_ops)
        alone = any(request.wants_prompt_logits for request, _ in prefills)
        if prefills and (self.policy.is_exclusive_prefill or alone):
            decodes = []
        pieces = [(request, self._num_uncomputed(request)) for request in decodes] + prefills
        room = self.max_draft_step_tokens - sum(n for _, n in pieces) \
            if self.max_draft_step_tokens else sys.maxsize  # for drafts, in this step
        if self.kv.draft_state_pool.num_slots:
            room = min(room, self.kv.num_free_draft_state_slots)
        for (request, n), guessed in zip(pieces, self._drafts(pieces, room), strict=True):
            output.sequences.append(self._scheduled(request, n, guessed,
                                                    self._draft_states(request, len(guessed),
                                                                       output.cache_ops)))
        return output

    def _draft_states(self, request: Request, num_drafts: int, ops: CacheOps) -> tuple[int, ...]:
        """A hybrid model's pass runs a piece's drafts into its state: the slots that keep the
        state after each checked row but the last, or () after queueing a copy of the state
        from before the pass (a model that keeps no such states)."""
        if not num_drafts or not self.kv.is_hybrid:
            return ()
        assert request.kv is not None
        if not self.kv.draft_state_pool.num_slots:
            ops.state_copies.append((request.kv.state_slot, request.kv.draft_slot))
            return ()
        slots = self.kv.take_draft_state_slots(num_drafts)
        self._draft_state_slots += slots
        return slots

    def update_from_output(self, output: SchedulerOutput) -> None:
        """Marks the step's tokens as computed (call after the forward pass succeeded); drafts
        count only as the engine confirms them (decoded), the rest of their KV is overwritten. A
        hybrid model's sequence that checked drafts waits for drafts_checked."""
        for seq in output.sequences:
            if not (seq.num_drafts and self.kv.is_hybrid):
                self._advance(self.requests[seq.request_id], len(seq.token_ids) - seq.num_drafts)

    def drafts_checked(self, request: Request, seq: ScheduledSequence, kept: int) -> bool:
        """The engine kept `kept` of the drafts of seq, a decode piece of the request. Returns
        whether the piece's fed tokens and the kept drafts count as computed now (decoded() then
        advances over each kept draft). A hybrid model's pass ran every draft into the recurrent
        state: when all were kept that is the state wanted; otherwise the state becomes the one
        the pass kept after the last kept token (draft_state_slots), or goes back to its copy
        from before the pass, and then the fed tokens, the kept drafts and the next token run
        again in the next step (their KV is rewritten with the same values)."""
        if not self.kv.is_hybrid:
            return True
        assert request.kv is not None
        if kept < seq.num_drafts and not seq.draft_state_slots:
            self.kv.restore_state(request.kv)
            return False
        if kept < seq.num_drafts:
            self.kv.restore_state(request.kv, seq.draft_state_slots[kept])
        self._advance(request, len(seq.token_ids) - seq.num_drafts)
        return True

    def extend_decodes(self, output: SchedulerOutput, n_steps: int) -> SchedulerOutput:
        """A decode-only output run as n_steps passes (each feeding the previous one's token):
        every sequence's block ids cover the n_steps tokens it computes. n_steps must not pass
        any request's max_tokens (its KV is reserved up to prompt + max_tokens)."""
        sequences = []
        for seq in output.sequences:
            request = self.requests[seq.request_id]
            assert request.kv is not None and n_steps <= request.params.max_tokens - \
                request.num_output_tokens
            n_blocks = self.kv.num_blocks_for(seq.start_position + n_steps)
            sequences.append(dataclasses.replace(seq, block_ids=request.kv.block_ids[:n_blocks]))
        return SchedulerOutput(sequences, output.cache_ops)

    def decoded(self, request: Request) -> None:
        """One pass of an extended decode computed the request's next token."""
        self._advance(request, 1)

    def _advance(self, request: Request, num_tokens: int) -> None:
        request.num_computed_tokens += num_tokens
        self.kv.computed(progress(request), request.num_computed_tokens - num_tokens)

    def finish(self, request: Request, reason: str, error: str | None = None,
               state_is_current: bool = True) -> None:
        """Ends a request in any state and frees its KV. state_is_current: its cached state
        matches its computed tokens (not after a failed pass, nor with passes queued past its
        end), so the prefix cache may keep a snapshot of it."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        del self.requests[request.request_id]
        if request.kv is not None:
            self.kv.free(request.kv, progress(request) if state_is_current else None)
            request.kv = None
        request.status, request.finish_reason, request.error = RequestStatus.FINISHED, reason, error
        request.finished_at = time.monotonic()

    def _pick_decodes(self) -> list[Request]:
        decodes = [r for r in self.running if not r.is_prefilling]
        decodes.sort(key=lambda r: (r.last_scheduled, r.arrival_seq))
        return decodes[:self.config.max_batch_tokens]

    def _pick_prefills(self, num_decodes: int, ops: CacheOps) -> list[tuple[Request, int]]:
        """The step's prefill pieces, [(request, prompt tokens)], in queue order: as many as the
        policy lets share a step and the step's token room holds. No request jumps the queue: the
        first one that cannot run now (KV, a sequence slot, the mix limit) ends the list."""
        exclusive = self.policy.is_exclusive_prefill
        if num_decodes >= self.config.max_batch_tokens and not exclusive:
            return []
        room = self._step_room(0 if exclusive else num_decodes)
        pieces: list[tuple[Request, int]] = []
        for request in self._prefill_queue()[:self.policy.max_prefills_per_step]:
            piece = self.policy.prefill_piece(self._num_uncomputed(request))
            if request.wants_prompt_logits:  # NOTE: alone, in pieces of bounded logits
                if pieces:
                    break
                piece = min(piece, PROMPT_LOGITS_PIECE)
            if self._must_wait(piece, num_decodes) or min(piece, room) <= 0 or \
                    (request.kv is None and not self._admit(request, ops)):
                break
            piece = min(piece, room, self._until_snapshot(request))
            pieces.append((request, piece))
            room -= piece
            if request.wants_prompt_logits:
                break
        return pieces

    def _step_room(self, num_decodes: int) -> int:
        """Prompt tokens the step may still take beside num_decodes decode tokens."""
        return (self.max_pass_tokens or sys.maxsize) - num_decodes

    @property
    def max_pass_tokens(self) -> int:
        """The most tokens a step carries: the policy's step budget or the model's pass limit,
        whichever is smaller (0 = no limit)."""
        return min((n for n in (self.policy.step_tokens, self.max_step_tokens) if n), default=0)

    def _num_uncomputed(self, request: Request) -> int:
        """Tokens still to compute; a request not yet admitted skips its prefix-cache hit."""
        if request.kv is not None:
            return request.num_tokens - request.num_computed_tokens
        if request.wants_prompt_logits:
            return request.num_tokens
        hit = self.kv.lookup(request.prompt_ids, request.block_keys)
        return request.num_tokens - hit.num_tokens

    def _until_snapshot(self, request: Request) -> int:
        """Prompt tokens the request may prefill before the prefix cache snapshots its state."""
        position = self.kv.next_snapshot_at(progress(request))
        return sys.maxsize if position is None else position - request.num_computed_tokens

    def _prefill_queue(self) -> list[Request]:
        """Running partial prefills first, then the waiting requests in policy order."""
        partial = [r for r in self.running if r.is_prefilling]
        return partial + sorted(self.waiting, key=self.policy.sort_key)

    def _must_wait(self, piece: int, num_decodes: int) -> bool:
        # NOTE: a long prefill waits for the decodes to drain (ITL spike otherwise)
        mix_max = self.policy.mix_max
        return bool(num_decodes and not self.policy.is_exclusive_prefill and mix_max and
                    piece > mix_max)

    def _admit(self, request: Request, ops: CacheOps) -> bool:
        """Moves the request to running if a sequence slot and its KV are free now."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        allocation = self.kv.allocate(request.prompt_ids, request.num_kv_tokens,
                                      request.block_keys, reuse=not request.wants_prompt_logits)
        if allocation is None:
            return False
        request.kv, request_ops = allocation
        ops.extend(request_ops)
        request.num_computed_tokens = request.num_cached_tokens = request.kv.num_cached_tokens
        request.status, request.scheduled_at = RequestStatus.RUNNING, time.monotonic()
        self.waiting.remove(request)
        self.running.append(request)
        return True

    def _scheduled(self, request: Request, num_new: int, drafts: list[int],
                   draft_state_slots: tuple[int, ...] = ()) -> ScheduledSequence:
        assert request.kv is not None
        self._num_scheduled += 1
        request.last_scheduled = self._num_scheduled
        start = request.num_computed_tokens
        end = start + num_new
        return ScheduledSequence(request.request_id, request.token_ids[start:end] + drafts, start,
                                 request.kv.block_ids[:self.kv.num_blocks_for(end + len(drafts))],
                                 request.kv.state_slot, end == request.num_tokens,
                                 request.wants_prompt_logits and start < request.num_prompt_tokens,
                                 len(drafts), draft_state_slots)

    def _drafts(self, pieces: list[tuple[Request, int]], room: int) -> list[list[int]]:
        """Each piece's drafts. A drafter that fails (a draft model's pass) costs this step its
        drafts, not the step: the cache operations already taken must still run."""
        wants = [(request, self._draft_limit(request, n)) for request, n in pieces]
        if self.budget is not None:
            num_decodes = sum(n == 1 and r.num_computed_tokens + 1 == r.num_tokens
                              for r, n in pieces)
            counts = self.budget.split(wants, num_decodes, room)
            wants = [(request, k) for (request, _), k in zip(wants, counts, strict=True)]
        try:
            return self.drafter.drafts(wants, room)
        except Exception:
            log.exception("drafting failed: this step checks no drafts")
            for request, _ in pieces:
                if request.drafting is not None:
                    request.drafting.draft_kv_tokens = 0  # recompute the drafter's KV
            return [[] for _ in pieces]

    def _draft_limit(self, request: Request, num_new: int) -> int:
        """The drafts a request's piece of this step may carry: none unless it decodes (it
        reaches the request's last token, its prompt computed: a prefix hit's block copies have
        reached the drafter's cache), else as many as its DraftLength allows now within the KV
        the request reserved. A hybrid model's piece of several decoded tokens (those a rejected
        check kept, run again from the restored state) drafts too: the step's room keeps it
        within a pass that computes each row as its decode would."""
        if request.num_computed_tokens + num_new != request.num_tokens or \
                request.num_computed_tokens < request.num_prompt_tokens or \
                request.drafting is None or (request.kv is not None and
                                             not self.kv.can_check_drafts(request.kv)):
            return 0
        return min(request.drafting.limit(request.num_tokens),
                   request.params.max_tokens - request.num_output_tokens)


def progress(request: Request) -> SequenceProgress:
    assert request.kv is not None
    return SequenceProgress(request.token_ids, request.block_keys, request.kv,
                            request.num_prompt_tokens, request.num_computed_tokens,
                            request.params.snapshot_positions)
