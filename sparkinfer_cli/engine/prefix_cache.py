"""PrefixCache: which KV blocks and recurrent-state snapshots hold which token prefixes.

A full block is indexed by a key that names everything before its end:
    key_k = blake2b(key_{k-1} ‖ token ids of block k),   key_{-1} = ROOT_KEY
so one dict lookup per block walks a prompt's cached prefix, and the stored (parent key, tokens)
of each hit is compared, so a hash collision can never hand out another prefix's KV.

A resume point is a position P where a request can pick up: the full blocks before P (found by the
walk), the KV of P's partial block (a tail block the point holds, copied, never shared, since its
owner may still write past P) and, for hybrid models, a snapshot of the recurrent state after P
tokens (a state slot of its own). Non-hybrid models resume at the deepest cached full block; hybrid
ones only where a snapshot exists, since KV alone cannot rebuild the Gated-DeltaNet state.

The configured shared prefix (SPARKINFER_SERVER_PREFIX_TOKEN_FILE) is a pinned resume point: it
holds all its blocks and is never evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from sparkinfer_cli.engine.block_pool import BlockPool, SlotPool

ROOT_KEY = b""
NO_STATE_SLOT = -1  # non-hybrid models keep no recurrent state


def extend_block_keys(keys: list[bytes], token_ids: Sequence[int], block_size: int,
                      num_blocks: int) -> list[bytes]:
    """Extends keys (the chain keys of token_ids' first len(keys) blocks) to num_blocks full
    blocks, in place; returns keys."""
    for k in range(len(keys), num_blocks):
        block = array("q", token_ids[k * block_size:(k + 1) * block_size]).tobytes()
        keys.append(hashlib.blake2b((keys[-1] if keys else ROOT_KEY) + block,
                                    digest_size=16).digest())
    return keys


@dataclass(eq=False)
class ResumePoint:
    num_tokens: int  # P: the tokens the point covers
    parent_key: bytes  # key of the last full block before P (ROOT_KEY when P < block_size)
    tail_tokens: tuple[int, ...]  # token ids of P's partial block, up to P
    tail_block: int | None  # the block holding the tail's KV (None when P is block-aligned)
    state_slot: int  # the recurrent-state snapshot after P tokens, or NO_STATE_SLOT
    held_blocks: tuple[int, ...]  # blocks the point holds a reference on
    pinned: bool = False


@dataclass(frozen=True)
class PrefixHit:
    """Where a request can start: num_tokens of its prompt are cached."""

    num_tokens: int = 0
    shared_blocks: tuple[int, ...] = ()  # full blocks the request uses in place
    tail_block: int | None = None  # copied into the request's first fresh block
    state_slot: int = NO_STATE_SLOT  # copied into the request's state slot


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, snapshot_slots: SlotPool,
                 needs_state: bool):
        """needs_state: the model is hybrid, so a request resumes only at a resume point with a
        state snapshot; snapshot_slots: the slots those snapshots take."""
        self.pool, self.block_size = pool, block_size
        self.snapshot_slots, self.needs_state = snapshot_slots, needs_state
        self._blocks: dict[bytes, int] = {}  # key → block
        self._content: dict[int, tuple[bytes, bytes, tuple[int, ...]]] = {}  # block → (key, parent
        # key, tokens)
        self._points: defaultdict[bytes, list[ResumePoint]] = defaultdict(list)  # by parent key
        self._recent: OrderedDict[int, ResumePoint] = OrderedDict()  # unpinned, LRU first

    # NOTE: the two counts below are read from other threads (engine stats): they iterate over a
    # copy taken in one C call, never over a dict the engine thread may be changing

    @property
    def num_snapshots(self) -> int:
        return self.snapshot_slots.num_slots - self.snapshot_slots.num_free_slots

    @property
    def num_reclaimable_blocks(self) -> int:
        """Blocks held only by unpinned resume points: evicting those points frees them."""
        holds = Counter(b for p in list(self._recent.values()) for b in p.held_blocks)
        return sum(self.pool.ref_count(b) == n for b, n in holds.items())

    # ---- lookup ----------------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int], keys: list[bytes], max_tokens: int) -> PrefixHit:
        """The deepest cached start for token_ids, covering at most max_tokens of them. keys: the
        chain keys of token_ids' blocks (extended here as needed)."""
        bs = self.block_size
        extend_block_keys(keys, token_ids, bs, max_tokens // bs)
        blocks = self._walk(token_ids, keys[:max_tokens // bs])
        point = self._deepest_point(token_ids, keys, len(blocks), max_tokens)
        if point is None or (not self.needs_state and point.num_tokens <= len(blocks) * bs):
            if self.needs_state:
                return PrefixHit()
            return PrefixHit(len(blocks) * bs, tuple(blocks))
        num_full = point.num_tokens // bs
        return PrefixHit(point.num_tokens, tuple(blocks[:num_full]), point.tail_block,
                         point.state_slot)

    def _walk(self, token_ids: Sequence[int], keys: Sequence[bytes]) -> list[int]:
        blocks: list[int] = []
        for k, key in enumerate(keys):
            block = self._blocks.get(key)
            tokens = tuple(token_ids[k * self.block_size:(k + 1) * self.block_size])
            parent = keys[k - 1] if k else ROOT_KEY
            if block is None or self._content[block] != (key, parent, tokens):
                break
            blocks.append(block)
        return blocks

    def _deepest_point(self, token_ids: Sequence[int], keys: Sequence[bytes], num_blocks: int,
                       max_tokens: int) -> ResumePoint | None:
        for k in range(num_blocks, -1, -1):
            start = k * self.block_size
            candidates = [p for p in self._points.get(keys[k - 1] if k else ROOT_KEY, ())
                          if p.num_tokens <= max_tokens and
                          (p.state_slot != NO_STATE_SLOT or not self.needs_state) and
                          tuple(token_ids[start:p.num_tokens]) == p.tail_tokens]
            if candidates:
                return max(candidates, key=lambda p: p.num_tokens)
        return None

    def _point_at(self, token_ids: Sequence[int], keys: Sequence[bytes],
                  num_tokens: int) -> ResumePoint | None:
        k = num_tokens // self.block_size
        tail = tuple(token_ids[k * self.block_size:num_tokens])
        for point in self._points.get(keys[k - 1] if k else ROOT_KEY, ()):
            if point.num_tokens == num_tokens and point.tail_tokens == tail:
                return point
        return None

    # ---- indexing --------------------------------------------------------------------------------
    def index_blocks(self, token_ids: Sequence[int], keys: list[bytes],
                     block_ids: Sequence[int], first: int, end: int) -> None:
        """Indexes blocks first..end-1 of a sequence (full, their KV computed). A prefix another
        block already holds keeps that block; this one stays private."""
        bs = self.block_size
        extend_block_keys(keys, token_ids, bs, end)
        for k in range(first, end):
            if keys[k] in self._blocks or block_ids[k] in self._content:
                continue
            tokens = tuple(token_ids[k * bs:(k + 1) * bs])
            self._blocks[keys[k]] = block_ids[k]
            self._content[block_ids[k]] = (keys[k], keys[k - 1] if k else ROOT_KEY, tokens)
            self.pool.mark_indexed(block_ids[k])

    def forget_block(self, block: int) -> None:
        """The pool evicted an unreferenced indexed block: drop it and the resume points right
        after it (deeper ones become unreachable and age out)."""
        key = self._content.pop(block)[0]
        del self._blocks[key]
        for point in list(self._points.get(key, ())):
            self._drop(point)

    def has_point(self, token_ids: Sequence[int], keys: list[bytes], num_tokens: int) -> bool:
        """Whether a resume point after token_ids[:num_tokens] exists (it counts as used)."""
        extend_block_keys(keys, token_ids, self.block_size, num_tokens // self.block_size)
        point = self._point_at(token_ids, keys, num_tokens)
        if point is not None and not point.pinned:
            self._recent.move_to_end(id(point))
        return point is not None

    def add_point(self, token_ids: Sequence[int], keys: list[bytes], block_ids: Sequence[int],
                  num_tokens: int, state_slot: int, pinned: bool = False) -> None:
        """A new resume point after token_ids[:num_tokens], whose KV is in block_ids. A pinned
        point holds all its blocks, an unpinned one only its tail block (the full ones must be
        indexed to be found)."""
        bs = self.block_size
        num_full = num_tokens // bs
        extend_block_keys(keys, token_ids, bs, num_full)
        tail_block = block_ids[num_full] if num_tokens % bs else None
        held = tuple(block_ids[:self.pool_blocks_for(num_tokens)]) if pinned else \
            (() if tail_block is None else (tail_block,))
        self.pool.share(held)
        point = ResumePoint(num_tokens, keys[num_full - 1] if num_full else ROOT_KEY,
                            tuple(token_ids[num_full * bs:num_tokens]), tail_block, state_slot,
                            held, pinned)
        self._points[point.parent_key].append(point)
        if not pinned:
            self._recent[id(point)] = point

    def pool_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- eviction --------------------------------------------------------------------------------
    def take_snapshot_slot(self) -> int | None:
        """A free snapshot slot, evicting the least recently used resume point with one if
        needed; None when every snapshot is pinned."""
        if self.snapshot_slots.num_free_slots == 0:
            victim = next((p for p in self._recent.values() if p.state_slot != NO_STATE_SLOT),
                          None)
            if victim is None:
                return None
            self._drop(victim)
        return self.snapshot_slots.allocate()

    def clear(self) -> int:
        """Drops every unpinned resume point (its tail block and snapshot slot) and every cached
        block no request holds; returns how many blocks that frees. Blocks running requests use
        stay indexed, so that clearing is safe mid-run: nothing a request reads is touched."""
        num_freed = self.num_reclaimable_blocks + self.pool.num_cached_blocks
        for point in list(self._recent.values()):
            self._drop(point)
        self.pool.evict_cached()
        return num_freed

    def reclaim_blocks(self, num_needed: int) -> None:
        """Evicts least recently used resume points until the pool can hand out num_needed
        blocks or none is left to evict."""
        while not self.pool.can_allocate(num_needed) and self._recent:
            self._drop(next(iter(self._recent.values())))

    def _drop(self, point: ResumePoint) -> None:
        self._points[point.parent_key].remove(point)
        if not self._points[point.parent_key]:
            del self._points[point.parent_key]
        self._recent.pop(id(point), None)
        self.pool.free(point.held_blocks)
        if point.state_slot != NO_STATE_SLOT:
            self.snapshot_slots.free(point.state_slot)
