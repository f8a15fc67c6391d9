"""BlockPool: KV block ids with reference counts, and SlotPool: recurrent-state slot ids.

Pure bookkeeping over ints; the tensors the ids index live in the model's ModelCache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockPool:
    """Hands out KV block ids; a block returns to the free queue when its last reference drops."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # NOTE: FIFO reuse, so a freed block is the last to be handed out again (easier debugging).
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        if not self.can_allocate(num):
            raise RuntimeError(f"block pool exhausted: {num} requested, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Add a reference to blocks someone already holds (prefix sharing)."""
        for block in blocks:
            if self._ref_counts[block] < 1:
                raise RuntimeError(f"block {block} is free and cannot be shared")
            self._ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if self._ref_counts[block] < 1:
                raise RuntimeError(f"block {block} freed twice")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]


class SlotPool:
    """Hands out recurrent-state slot ids (one per running sequence of a hybrid model)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
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
