"""KVCacheManager: per-request KV blocks and recurrent-state slots, and the prefix cache over them.

A request reserves blocks for prompt + max_tokens at admission, so it never needs more while it runs
(no preemption). It starts from the deepest cached prefix of its prompt (PrefixCache.match):

    block table of a prefix hit: [ cached full blocks (shared) | copy of the tail block | fresh ]
                                   ref-counted                   copy_blocks before the next pass

Automatic caching (on by default) indexes every block a request fills, so its blocks outlive it
as evictable cache; for hybrid models it also snapshots the recurrent state at the end of each
prompt, every `snapshot_interval` prompt tokens and where a request ends. Off, only the configured
shared prefix is reused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sparkinfer_cli.engine.block_pool import BlockPool, SlotPool
from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.engine.prefix_cache import NO_STATE_SLOT, PrefixCache, PrefixHit

__all__ = ["NO_STATE_SLOT", "CacheOps", "KVBlocks", "KVCacheManager", "PrefixCacheStats",
           "SequenceProgress"]


@dataclass(frozen=True)
class KVBlocks:
    """What a request owns in the cache."""

    block_ids: tuple[int, ...]
    state_slot: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache at admission
    # a hybrid model's copy of state_slot from before a pass that checks drafts (NO_STATE_SLOT:
    # the request drafts nothing, or the model has no recurrent state)
    draft_slot: int = NO_STATE_SLOT


@dataclass(frozen=True)
class PrefixCacheStats:
    queried_tokens: int  # prompt tokens of admitted requests
    hit_tokens: int  # of those, found in the cache
    cached_blocks: int  # unreferenced blocks kept for their content (counted as free)
    snapshots: int  # recurrent-state snapshots held (hybrid models)
    snapshot_slots: int  # snapshots the pool has room for


@dataclass
class SequenceProgress:
    """A sequence as the cache sees it: token_ids[:num_computed] have KV in kv's blocks."""

    token_ids: Sequence[int]
    block_keys: list[bytes]  # chain keys of its full blocks (PrefixCache), extended lazily
    kv: KVBlocks
    num_prompt_tokens: int
    num_computed: int
    snapshot_positions: tuple[int, ...] = ()  # SamplingParams.snapshot_positions


@dataclass
class CacheOps:
    """ModelCache work that must run before the next forward pass (copy-on-write, state init).
    State copies run in list order: snapshots taken after a pass come before the restores a later
    admission adds, so a snapshot is always saved before anything reads or reuses its slot."""

    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst)
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # (src slot, dst slot)
    state_resets: list[int] = field(default_factory=list)

    def extend(self, other: CacheOps) -> None:
        self.block_copies += other.block_copies
        self.state_copies += other.state_copies
        self.state_resets += other.state_resets

    @property
    def is_empty(self) -> bool:
        return not (self.block_copies or self.state_copies or self.state_resets)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_seq_slots: int,
                 prefix_token_ids: Sequence[int] = (), *, num_snapshot_slots: int = 0,
                 auto_prefix_cache: bool = True, snapshot_interval: int = 0,
                 draft_slots: bool = False, draft_state_slots: int = 0):
        """num_seq_slots: recurrent-state slots for running sequences (0 for non-hybrid models);
        num_snapshot_slots: slots for prefix-cache snapshots after them (hybrid models; the
        configured prefix takes one); snapshot_interval: prompt tokens between snapshots of a
        long prompt (a multiple of block_size; 0 = none). Speculative decoding on a hybrid
        model: draft_state_slots > 0, the last that many running slots take the states after
        the rows a step's checks carry (a model that snapshots_draft_states), one a draft;
        else draft_slots: each request takes two running slots, its state's and a copy from
        before a pass that checks drafts."""
        self.block_size = block_size
        self.draft_slots = draft_slots and num_seq_slots > 0 and not draft_state_slots
        self.auto = auto_prefix_cache
        self.snapshot_interval = snapshot_interval
        self.block_pool = BlockPool(num_blocks,
                                    on_evict=lambda b: self.prefix_cache.forget_block(b))
        self.slot_pool = SlotPool(num_seq_slots - draft_state_slots)
        self.draft_state_pool = SlotPool(draft_state_slots, first=num_seq_slots - draft_state_slots)
        self.prefix_cache = PrefixCache(self.block_pool, block_size,
                                        SlotPool(num_snapshot_slots, first=num_seq_slots),
                                        needs_state=num_seq_slots > 0)
        self.prefix_token_ids = tuple(prefix_token_ids)
        self.pending = CacheOps()  # snapshots to save before the next pass
        self.num_queried_tokens = 0  # prompt tokens of admitted requests
        self.num_hit_tokens = 0  # of those, found in the prefix cache
        self.prefix: KVBlocks | None = None
        if self.prefix_token_ids:
            n = len(self.prefix_token_ids)
            slot = self.prefix_cache.snapshot_slots.allocate() if self.is_hybrid else NO_STATE_SLOT
            self.prefix = KVBlocks(tuple(self.block_pool.allocate(self.num_blocks_for(n))), slot, 0)

    @classmethod
    def from_config(cls, config: EngineConfig, is_hybrid: bool, draft_slots: bool = False,
                    snapshots_draft_states: bool = False) -> KVCacheManager:
        """draft_slots: the engine checks drafts (speculative decoding); snapshots_draft_states:
        the model keeps the state after each checked row (ModelBackend)."""
        drafts = is_hybrid and draft_slots
        num_seq_slots = config.num_seq_slots(is_hybrid, drafts)
        interval = config.prefix_snapshot_tokens // config.block_size * config.block_size
        return cls(config.num_blocks, config.block_size, num_seq_slots, config.prefix_token_ids,
                   num_snapshot_slots=config.num_snapshot_slots(is_hybrid),
                   auto_prefix_cache=config.prefix_cache, snapshot_interval=interval,
                   draft_slots=drafts, draft_state_slots=num_seq_slots - config.max_num_seqs
                   if drafts and snapshots_draft_states else 0)

    @property
    def num_state_slots(self) -> int:
        """Recurrent-state slots the model cache needs: running sequences' (and the draft
        states'), then snapshots."""
        return self.slot_pool.num_slots + self.draft_state_pool.num_slots + \
            self.prefix_cache.snapshot_slots.num_slots

    def can_check_drafts(self, kv: KVBlocks) -> bool:
        """A request's pass may carry drafts: the model has no recurrent state, or the state
        after a rejected draft can be had (a draft state slot, or the request's copy)."""
        return not self.is_hybrid or self.draft_state_pool.num_slots > 0 or \
            kv.draft_slot != NO_STATE_SLOT

    @property
    def is_hybrid(self) -> bool:
        return self.slot_pool.num_slots > 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request could get now: free, cached but unreferenced, or held only by
        resume points that can be evicted."""
        return self.block_pool.num_free_blocks + self.prefix_cache.num_reclaimable_blocks

    @property
    def max_request_tokens(self) -> int:
        """prompt + max_tokens of the largest request that fits in an otherwise empty cache."""
        num_prefix_blocks = len(self.prefix.block_ids) if self.prefix else 0
        return (self.block_pool.num_blocks - num_prefix_blocks) * self.block_size

    def prefix_stats(self) -> PrefixCacheStats:
        snapshots = self.prefix_cache.snapshot_slots
        return PrefixCacheStats(self.num_queried_tokens, self.num_hit_tokens,
                                self.block_pool.num_cached_blocks,
                                self.prefix_cache.num_snapshots, snapshots.num_slots)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- admission -------------------------------------------------------------------------------
    def lookup(self, prompt_ids: Sequence[int], keys: list[bytes]) -> PrefixHit:
        """The cached start of a prompt (at least its last token is left to compute)."""
        return self.prefix_cache.match(prompt_ids, keys, len(prompt_ids) - 1)

    def allocate(self, prompt_ids: Sequence[int], num_tokens: int,
                 keys: list[bytes] | None = None,
                 reuse: bool = True) -> tuple[KVBlocks, CacheOps] | None:
        """Blocks for num_tokens positions (prompt + max_tokens) starting from the prompt's
        cached prefix (reuse=False: from scratch), or None if they do not fit now (nothing is
        taken then)."""
        keys = [] if keys is None else keys
        hit = self.lookup(prompt_ids, keys) if reuse else PrefixHit()
        num_fresh = self.num_blocks_for(num_tokens) - len(hit.shared_blocks)
        if self.is_hybrid and self.slot_pool.num_free_slots < (2 if self.draft_slots else 1):
            return None
        held = (*hit.shared_blocks, *(() if hit.tail_block is None else (hit.tail_block,)))
        self.block_pool.share(held)  # NOTE: before any eviction, so none of them is evicted
        self.prefix_cache.reclaim_blocks(num_fresh)
        if not self.block_pool.can_allocate(num_fresh):
            self.block_pool.free(held)
            return None
        self.prefix_cache.has_point(prompt_ids, keys, hit.num_tokens)  # NOTE: marks it used
        fresh = self.block_pool.allocate(num_fresh)
        if hit.tail_block is not None:
            self.block_pool.free([hit.tail_block])  # the copy below runs before any reuse
        kv = KVBlocks(hit.shared_blocks + tuple(fresh), self._allocate_slot(), hit.num_tokens,
                      self._allocate_slot() if self.draft_slots else NO_STATE_SLOT)
        self.num_queried_tokens += len(prompt_ids)
        self.num_hit_tokens += hit.num_tokens
        return kv, self._init_ops(kv, hit, fresh)

    def _init_ops(self, kv: KVBlocks, hit: PrefixHit, fresh: list[int]) -> CacheOps:
        ops = CacheOps()
        if hit.tail_block is not None:
            ops.block_copies.append((hit.tail_block, fresh[0]))
        if kv.state_slot != NO_STATE_SLOT and hit.state_slot != NO_STATE_SLOT:
            ops.state_copies.append((hit.state_slot, kv.state_slot))
        elif kv.state_slot != NO_STATE_SLOT:
            ops.state_resets.append(kv.state_slot)
        return ops

    def take_pending_ops(self) -> CacheOps:
        ops, self.pending = self.pending, CacheOps()
        return ops

    # ---- progress --------------------------------------------------------------------------------
    def next_snapshot_at(self, seq: SequenceProgress) -> int | None:
        """The prompt position where the sequence's prefill must pause for a state snapshot: the
        next multiple of the interval or the next position the request asked for."""
        if not (self.auto and self.is_hybrid):
            return None
        step = self.snapshot_interval
        wanted = [(seq.num_computed // step + 1) * step] if step else []
        wanted += [p for p in seq.snapshot_positions if p > seq.num_computed]
        position = min(wanted, default=None)
        return position if position is not None and position < seq.num_prompt_tokens else None

    def computed(self, seq: SequenceProgress, num_before: int) -> None:
        """seq's KV now covers seq.num_computed tokens, num_before before the last pass: index
        the blocks that became full and snapshot the state where a resume point belongs."""
        if not self.auto:
            return
        bs = self.block_size
        self.prefix_cache.index_blocks(seq.token_ids, seq.block_keys, seq.kv.block_ids,
                                       num_before // bs, seq.num_computed // bs)
        n = seq.num_computed
        wanted = n == seq.num_prompt_tokens or n in seq.snapshot_positions or \
            (self.snapshot_interval and n % self.snapshot_interval == 0)
        if self.is_hybrid and num_before < seq.num_prompt_tokens and wanted:
            self._snapshot(seq)

    def free(self, kv: KVBlocks, seq: SequenceProgress | None = None) -> None:
        """Releases a request's blocks and slot. seq: the request as it ends, its state current,
        so a hybrid model keeps a snapshot there (None: its state is not kept)."""
        if seq is not None and self.auto and self.is_hybrid and seq.num_computed:
            self._snapshot(seq)
        self.block_pool.free(kv.block_ids)
        for slot in (kv.state_slot, kv.draft_slot):
            if slot != NO_STATE_SLOT:
                self.slot_pool.free(slot)

    def restore_state(self, kv: KVBlocks, slot: int = NO_STATE_SLOT) -> None:
        """Before the next pass, the sequence's state becomes slot's (a draft check's state at
        its last kept token), or by default goes back to its copy from before the pass that
        checked its drafts (some were rejected: that pass also ran them)."""
        self.pending.state_copies.append((kv.draft_slot if slot == NO_STATE_SLOT else slot,
                                          kv.state_slot))

    def take_draft_state_slots(self, n: int) -> tuple[int, ...]:
        """n of the draft state slots (at most num_free_draft_state_slots), for a step."""
        return tuple(self.draft_state_pool.allocate() for _ in range(n))

    def free_draft_state_slots(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.draft_state_pool.free(slot)

    @property
    def num_free_draft_state_slots(self) -> int:
        return self.draft_state_pool.num_free_slots

    def pin_prefix(self) -> None:
        """The configured prefix's KV (and state) is computed: make it a pinned resume point."""
        assert self.prefix is not None
        ids, keys = self.prefix_token_ids, list[bytes]()
        full = len(ids) // self.block_size
        self.prefix_cache.index_blocks(ids, keys, self.prefix.block_ids, 0, full)
        self.prefix_cache.add_point(ids, keys, self.prefix.block_ids, len(ids),
                                    self.prefix.state_slot, pinned=True)

    def _snapshot(self, seq: SequenceProgress) -> None:
        keys, n = seq.block_keys, seq.num_computed
        if self.prefix_cache.has_point(seq.token_ids, keys, n):
            return
        slot = self.prefix_cache.take_snapshot_slot()
        if slot is None:
            return
        self.prefix_cache.add_point(seq.token_ids, keys, seq.kv.block_ids, n, slot)
        self.pending.state_copies.append((seq.kv.state_slot, slot))

    def _allocate_slot(self) -> int:
        return self.slot_pool.allocate() if self.is_hybrid else NO_STATE_SLOT
