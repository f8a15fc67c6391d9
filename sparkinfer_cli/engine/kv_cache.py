"""KVCacheManager: per-request KV blocks and recurrent-state slots, plus the shared prefix.

A request reserves blocks for prompt + max_tokens at admission, so it never needs more while it runs
(no preemption). The configured shared prefix owns dedicated blocks (and, for hybrid models, a state
snapshot slot) for the engine's lifetime; a request whose prompt starts with it shares them:

    block table of a prefix hit: [ full prefix blocks (shared) | copy of partial block | fresh ]
                                    ref-counted                  copy_blocks at admission
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sparkinfer_cli.engine.block_pool import BlockPool, SlotPool

NO_STATE_SLOT = -1  # non-hybrid models keep no recurrent state


@dataclass(frozen=True)
class KVBlocks:
    """What a request owns in the cache."""

    block_ids: tuple[int, ...]
    state_slot: int
    num_cached_tokens: int  # prompt tokens already in these blocks (a prefix hit), 0 otherwise


@dataclass
class CacheOps:
    """ModelCache work that must run before the next forward pass (copy-on-write, state init)."""

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
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int,
                 prefix_token_ids: Sequence[int] = ()):
        """num_state_slots: 0 for non-hybrid models; for hybrids, one more than max_num_seqs when
        a prefix is configured (the snapshot)."""
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.slot_pool = SlotPool(num_state_slots)
        self.prefix_token_ids = tuple(prefix_token_ids)
        self.prefix: KVBlocks | None = None
        if self.prefix_token_ids:
            n = len(self.prefix_token_ids)
            self.prefix = KVBlocks(tuple(self.block_pool.allocate(self.num_blocks_for(n))),
                                   self._allocate_slot(), 0)

    @property
    def is_hybrid(self) -> bool:
        return self.slot_pool.num_slots > 0

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def max_request_tokens(self) -> int:
        """prompt + max_tokens of the largest request that fits in an otherwise empty cache."""
        num_prefix_blocks = len(self.prefix.block_ids) if self.prefix else 0
        return (self.block_pool.num_blocks - num_prefix_blocks) * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_prefix_hit_tokens(self, prompt_ids: Sequence[int]) -> int:
        """Length of the shared prefix if the prompt starts with it and goes beyond it, else 0."""
        n = len(self.prefix_token_ids)
        if n and len(prompt_ids) > n and tuple(prompt_ids[:n]) == self.prefix_token_ids:
            return n
        return 0

    def allocate(self, prompt_ids: Sequence[int],
                 num_tokens: int) -> tuple[KVBlocks, CacheOps] | None:
        """Blocks for num_tokens positions (prompt + max_tokens), or None if they do not fit now."""
        num_hit = self.num_prefix_hit_tokens(prompt_ids)
        shared = self.prefix.block_ids[:num_hit // self.block_size] if self.prefix else ()
        num_fresh = self.num_blocks_for(num_tokens) - len(shared)
        if not self.block_pool.can_allocate(num_fresh) or \
                (self.is_hybrid and self.slot_pool.num_free_slots == 0):
            return None
        self.block_pool.share(shared)
        fresh = self.block_pool.allocate(num_fresh)
        kv = KVBlocks(tuple(shared) + tuple(fresh), self._allocate_slot(), num_hit)
        return kv, self._init_ops(kv, fresh)

    def _init_ops(self, kv: KVBlocks, fresh: list[int]) -> CacheOps:
        ops = CacheOps()
        prefix = self.prefix if kv.num_cached_tokens else None
        if prefix and kv.num_cached_tokens % self.block_size:
            ops.block_copies.append((prefix.block_ids[kv.num_cached_tokens // self.block_size],
                                     fresh[0]))
        if kv.state_slot != NO_STATE_SLOT and prefix:
            ops.state_copies.append((prefix.state_slot, kv.state_slot))
        elif kv.state_slot != NO_STATE_SLOT:
            ops.state_resets.append(kv.state_slot)
        return ops

    def free(self, kv: KVBlocks) -> None:
        self.block_pool.free(kv.block_ids)
        if kv.state_slot != NO_STATE_SLOT:
            self.slot_pool.free(kv.state_slot)

    def _allocate_slot(self) -> int:
        return self.slot_pool.allocate() if self.is_hybrid else NO_STATE_SLOT
