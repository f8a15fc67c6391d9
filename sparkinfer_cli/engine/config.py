"""EngineConfig: the continuous-batching engine's knobs (seed README env vars), validated once."""

from __future__ import annotations

from dataclasses import dataclass

SCHED_POLICIES = ("batched", "continuous", "chunked", "priority")
# the batched policy's step budget where the environment sets none: a GPU prefills a 2,048-token
# piece in tens of ms; a CPU runs ~100 prompt tokens a second, so a smaller piece keeps the
# running streams' inter-token gap near a second
DEFAULT_STEP_TOKENS = {"cuda": 2048, "cpu": 256}
MAX_SPEC_TOKENS = 7  # drafts a decode step checks at most (n-gram speculation)
# the recurrent states a step's checks keep at most when every sequence drafts (a hybrid model's
# draft state slots): CUDA checks a step's drafts in passes of at most 16 tokens
MAX_DRAFT_STATES = 16


class QueueFullError(Exception):
    """In-flight + queued requests reached max_queue_depth (HTTP 429)."""


class RequestTooLargeError(ValueError):
    """prompt + max_tokens can never fit in the context (HTTP 400)."""


class EngineStoppedError(Exception):
    """The engine is shutting down or stopped and accepts no new requests (HTTP 503)."""


@dataclass(frozen=True)
class EngineConfig:
    ctx: int = 4096  # KV pool size in tokens over all sequences (CTX / --ctx)
    block_size: int = 16
    max_batch_tokens: int = 64  # decode tokens packed per step before a prefill may join
    sched_policy: str = "batched"  # batched | continuous | chunked | priority
    # batched policy: tokens one step carries at most, decodes and prompt pieces together
    # (vLLM's max_num_batched_tokens); bounds how long a step with prefills stalls the decodes
    step_tokens: int = 2048
    prefill_chunk_tokens: int = 512  # 0 = unlimited
    prefill_mix_max: int = 2048  # longest prefill piece run alongside decodes (0 = always mix)
    prefill_batched: bool = True  # False: prefills always advance in prefill_chunk_tokens pieces
    max_queue_depth: int = 0  # in-flight + queued (0 = unlimited)
    max_output_tokens: int = 4096
    request_timeout_s: float = 0.0  # 0 = off
    max_num_seqs: int = 64
    prefix_token_ids: tuple[int, ...] = ()
    prefix_cache: bool = True  # reuse the KV of earlier requests' prefixes (automatic caching)
    # hybrid models: recurrent-state snapshots the prefix cache keeps (0 = one per max_num_seqs),
    # and the prompt tokens between snapshots of one long prompt (rounded down to whole blocks)
    prefix_snapshots: int = 0
    prefix_snapshot_tokens: int = 4096
    sampling_threads: int = 0  # argmax threads for greedy rows (0 = auto, 1 = none)
    # decode passes queued at once while every running sequence decodes greedily and nothing
    # waits (models with decode_greedy; 1 = one pass a step)
    decode_steps: int = 8
    # n-gram speculative decoding: drafted tokens a plain-greedy decode step checks at once, on
    # models that score drafts (ModelBackend.scores_drafts); 0 = off
    spec_tokens: int = 0
    # drafts a step carries follow what a pass's rows cost and how often each request's drafts
    # are kept (DraftBudget); False: each request drafts as many as its DraftLength allows. Off
    # by default until measured on a GPU: it decides from wall-clock pass times, and one noisy
    # measurement on a busy host can stop a request's drafting for hundreds of steps
    draft_budget: bool = False
    step_trace: str = ""  # file that gets one JSON line per step (StepTrace); "" = none

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix_token_ids", tuple(int(t) for t in self.prefix_token_ids))
        checks = [
            (self.block_size >= 1, "block_size must be at least 1"),
            (self.ctx >= self.block_size, "ctx must hold at least one KV block"),
            (self.max_batch_tokens >= 1, "max_batch_tokens must be at least 1"),
            (self.step_tokens >= 1, "step_tokens must be at least 1"),
            (self.sched_policy in SCHED_POLICIES,
             f"sched_policy must be one of {', '.join(SCHED_POLICIES)}, not {self.sched_policy!r}"),
            (self.prefill_chunk_tokens >= 0, "prefill_chunk_tokens must be >= 0"),
            (self.prefill_mix_max >= 0, "prefill_mix_max must be >= 0"),
            (self.max_queue_depth >= 0, "max_queue_depth must be >= 0"),
            (self.max_output_tokens >= 1, "max_output_tokens must be at least 1"),
            (self.request_timeout_s >= 0, "request_timeout_s must be >= 0"),
            (self.max_num_seqs >= 1, "max_num_seqs must be at least 1"),
            (all(t >= 0 for t in self.prefix_token_ids), "prefix token ids must be >= 0"),
            (self.sampling_threads >= 0, "sampling_threads must be >= 0"),
            (self.decode_steps >= 1, "decode_steps must be at least 1"),
            (0 <= self.spec_tokens <= MAX_SPEC_TOKENS,
             f"spec_tokens must be in [0, {MAX_SPEC_TOKENS}]"),
            (self.prefix_snapshots >= 0, "prefix_snapshots must be >= 0"),
            (self.prefix_snapshot_tokens >= 0, "prefix_snapshot_tokens must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if -(-len(self.prefix_token_ids) // self.block_size) >= self.num_blocks:
            raise ValueError("the shared prefix leaves no KV block for requests: "
                             "raise ctx or shorten the prefix")

    @property
    def num_blocks(self) -> int:
        return self.ctx // self.block_size

    def num_snapshot_slots(self, is_hybrid: bool) -> int:
        """Recurrent-state slots beside the running sequences': prefix-cache snapshots and the
        configured prefix's state (hybrid models only)."""
        if not is_hybrid:
            return 0
        cached = (self.prefix_snapshots or self.max_num_seqs) if self.prefix_cache else 0
        return cached + int(bool(self.prefix_token_ids))

    def num_seq_slots(self, is_hybrid: bool, checks_drafts: bool) -> int:
        """Recurrent-state slots of running sequences: one each, and when the engine checks
        drafts the slots a step's checks keep the states after their rows in (KVCacheManager's
        draft_state_slots: one a draft of every sequence, up to MAX_DRAFT_STATES), at least one
        a sequence (a backend without those states copies each sequence's state before its
        check instead)."""
        if not is_hybrid:
            return 0
        n = self.max_num_seqs
        drafts = max(n, min(n * self.spec_tokens, MAX_DRAFT_STATES)) if checks_drafts else 0
        return n + drafts

    def num_state_slots(self, is_hybrid: bool) -> int:
        """Every recurrent-state slot the engine allocates, at most: the running sequences'
        (speculation's copies included where spec_tokens asks for them), then snapshots."""
        return self.num_seq_slots(is_hybrid, self.spec_tokens > 0) + \
            self.num_snapshot_slots(is_hybrid)
