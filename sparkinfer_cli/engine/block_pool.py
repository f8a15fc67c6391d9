"""BlockPool: KV block ids with reference counts, and SlotPool: recurrent-state slot ids.

Pure bookkeeping over ints; the tensors the ids index live in the model's ModelCache.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable


class BlockPool:
    """Hands out KV block ids. A block whose last reference drops returns to the free queue, or,
    when the prefix cache indexes its content, waits as an evictable block: still matchable,
    handed out (least recently released first) only when no free block is left."""

    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] = lambda block: None):
        """on_evict(block): an evictable block is handed out again; its content is gone."""
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # NOTE: FIFO reuse, so a freed block is the last to be handed out again (easier debugging).
        self._free: deque[int] = deque(range(num_blocks))
        self._indexed: set[int] = set()  # blocks whose content the prefix cache can match
        self._evictable: OrderedDict[int, None] = OrderedDict()  # indexed, unreferenced; LRU first
        self._on_evict = on_evict

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks kept for their content."""
        return len(self._evictable)

    def can_allocate(self, num: int) -> bool:
        return num <= self.num_free_blocks

    def allocate(self, num: int) -> list[int]:
        if not self.can_allocate(num):
            raise RuntimeError(f"block pool exhausted: {num} requested, "
                               f"{self.num_free_blocks} free")
        blocks = [self._take_one() for _ in range(num)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Add a reference to blocks someone holds, or to evictable ones (a prefix-cache hit)."""
        for block in blocks:
            if self._ref_counts[block] < 1 and block not in self._evictable:
                raise RuntimeError(f"block {block} is free and cannot be shared")
            self._evictable.pop(block, None)
            self._ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drops one reference of each block; pass a request's blocks in order, so its deepest
        cached blocks are evicted first and its shallower ones (a longer-lived prefix) last."""
        for block in reversed(list(blocks)):
            if self._ref_counts[block] < 1:
                raise RuntimeError(f"block {block} freed twice")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] > 0:
                continue
            if block in self._indexed:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def mark_indexed(self, block: int) -> None:
        """The prefix cache indexes the block's content (it is full and will not change)."""
        self._indexed.add(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def evict_cached(self) -> None:
        """Evicts every evictable block now (its content forgotten through on_evict) into the
        free queue; blocks someone holds stay indexed."""
        while self._evictable:
            self._free.append(self._evict_oldest())

    def _take_one(self) -> int:
        return self._free.popleft() if self._free else self._evict_oldest()

    def _evict_oldest(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        self._indexed.discard(block)
        self._on_evict(block)
        return block


class SlotPool:
    """Hands out recurrent-state slot ids from first, first + 1, …, first + num_slots - 1 (one per
    running sequence of a hybrid model, or one per prefix-cache snapshot)."""

    def __init__(self, num_slots: int, first: int = 0):
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(first, first + num_slots))
        self._used: set[int] = set()

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("state slot pool exhausted")
        slot = self._free.popleft()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"state slot {slot} freed twice")
        self._used.remove(slot)
        self._free.append(slot)
