"""BlockPool / SlotPool / KVCacheManager bookkeeping, including the shared prefix."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkinfer_cli.engine.block_pool import BlockPool, SlotPool
from sparkinfer_cli.engine.kv_cache import NO_STATE_SLOT, KVCacheManager


def test_allocate_and_free_restore_the_pool():
    pool = BlockPool(8)
    a, b = pool.allocate(3), pool.allocate(5)
    assert pool.num_free_blocks == 0 and not pool.can_allocate(1)
    assert sorted(a + b) == list(range(8))
    pool.free(a)
    assert pool.num_free_blocks == 3
    pool.free(b)
    assert pool.num_free_blocks == 8


def test_shared_block_returns_after_last_reference():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.share(blocks)
    assert [pool.ref_count(b) for b in blocks] == [2, 2]
    pool.free(blocks)
    assert pool.num_free_blocks == 2
    pool.free(blocks)
    assert pool.num_free_blocks == 4


def test_misuse_is_refused():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(3)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="twice"):
        pool.free(blocks)
    with pytest.raises(RuntimeError, match="cannot be shared"):
        pool.share(blocks)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_slot_pool():
    slots = SlotPool(2)
    a, b = slots.allocate(), slots.allocate()
    assert {a, b} == {0, 1} and slots.num_free_slots == 0
    with pytest.raises(RuntimeError):
        slots.allocate()
    slots.free(a)
    with pytest.raises(RuntimeError, match="twice"):
        slots.free(a)
    assert slots.num_free_slots == 1


def test_allocation_covers_prompt_plus_max_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=4, num_seq_slots=0)
    kv_blocks, ops = kv.allocate([1, 2, 3], num_tokens=9)  # 9 positions → 3 blocks
    assert len(kv_blocks.block_ids) == 3 and kv_blocks.state_slot == NO_STATE_SLOT
    assert kv_blocks.num_cached_tokens == 0 and ops.is_empty
    assert kv.num_free_blocks == 7
    assert kv.allocate([1], num_tokens=29) is None  # 8 blocks do not fit now
    assert kv.num_free_blocks == 7  # a refused allocation takes nothing
    kv.free(kv_blocks)
    assert kv.num_free_blocks == 10 and kv.max_request_tokens == 40


def test_hybrid_allocation_resets_a_fresh_state_slot():
    kv = KVCacheManager(num_blocks=10, block_size=4, num_seq_slots=2)
    first, ops = kv.allocate([1], 4)
    assert ops.state_resets == [first.state_slot] and not ops.state_copies
    second, _ = kv.allocate([1], 4)
    assert kv.allocate([1], 4) is None  # blocks are free, but no state slot is
    kv.free(first)
    kv.free(second)
    assert kv.slot_pool.num_free_slots == 2


def test_draft_slots_give_each_hybrid_request_a_second_slot_for_its_state_before_a_check():
    kv = KVCacheManager(num_blocks=10, block_size=4, num_seq_slots=4, draft_slots=True)
    first, _ = kv.allocate([1], 4)
    second, _ = kv.allocate([1], 4)
    slots = {first.state_slot, first.draft_slot, second.state_slot, second.draft_slot}
    assert slots == {0, 1, 2, 3}
    assert kv.allocate([1], 4) is None  # two slots a request: none left
    kv.restore_state(first)
    assert kv.take_pending_ops().state_copies == [(first.draft_slot, first.state_slot)]
    kv.free(first)
    kv.free(second)
    assert kv.slot_pool.num_free_slots == 4
    plain = KVCacheManager(num_blocks=10, block_size=4, num_seq_slots=0, draft_slots=True)
    assert plain.allocate([1], 4)[0].draft_slot == NO_STATE_SLOT  # no recurrent state to copy


def test_draft_state_slots_are_a_pool_a_step_s_checks_take_and_give_back():
    """A model that keeps the state after each checked row: each request takes one running
    slot, the last draft_state_slots of them are a pool; a rejection's state comes from one."""
    kv = KVCacheManager(num_blocks=10, block_size=4, num_seq_slots=5, draft_slots=True,
                        draft_state_slots=3)
    first, _ = kv.allocate([1], 4)
    second, _ = kv.allocate([1], 4)
    assert {first.state_slot, second.state_slot} == {0, 1}
    assert first.draft_slot == NO_STATE_SLOT and kv.can_check_drafts(first)
    assert kv.num_state_slots == 5 and kv.num_free_draft_state_slots == 3
    taken = kv.take_draft_state_slots(3)
    assert sorted(taken) == [2, 3, 4] and kv.num_free_draft_state_slots == 0
    kv.restore_state(first, taken[1])
    assert kv.take_pending_ops().state_copies == [(taken[1], first.state_slot)]
    kv.free_draft_state_slots(taken)
    assert kv.num_free_draft_state_slots == 3
    assert kv.allocate([1], 4) is None  # the pool is not the running sequences'


PREFIX = (5, 6, 7, 8, 9, 10)  # 6 tokens, block_size 4: one full block + a partial one


def test_prefix_hit_shares_full_blocks_and_copies_the_partial_one():
    kv = KVCacheManager(num_blocks=10, block_size=4, num_seq_slots=2, prefix_token_ids=PREFIX,
                        num_snapshot_slots=1)
    kv.pin_prefix()
    prefix = kv.prefix
    assert len(prefix.block_ids) == 2 and kv.num_free_blocks == 8 and kv.max_request_tokens == 32
    hit, ops = kv.allocate([*PREFIX, 1, 2], num_tokens=12)  # 12 positions → 3 blocks
    assert hit.num_cached_tokens == 6
    assert hit.block_ids[0] == prefix.block_ids[0]  # shared full block
    assert hit.block_ids[1] not in prefix.block_ids  # the partial block is a private copy
    assert ops.block_copies == [(prefix.block_ids[1], hit.block_ids[1])]
    assert ops.state_copies == [(prefix.state_slot, hit.state_slot)] and not ops.state_resets
    pinned_refs = kv.block_pool.ref_count(prefix.block_ids[1])
    assert kv.block_pool.ref_count(prefix.block_ids[0]) == pinned_refs + 1
    assert kv.num_free_blocks == 6  # only the 2 non-shared blocks came from the pool
    kv.free(hit)
    assert kv.num_free_blocks == 8
    assert kv.block_pool.ref_count(prefix.block_ids[0]) == pinned_refs


@pytest.mark.parametrize("prompt", [[5, 6, 7, 1, 2, 3, 4], [1, *PREFIX]])
def test_no_prefix_hit_without_a_match(prompt):
    kv = KVCacheManager(num_blocks=10, block_size=4, num_seq_slots=0, prefix_token_ids=PREFIX)
    kv.pin_prefix()
    blocks, ops = kv.allocate(prompt, num_tokens=len(prompt) + 2)
    assert blocks.num_cached_tokens == 0 and ops.is_empty
    assert not set(blocks.block_ids) & set(kv.prefix.block_ids)


def test_a_prompt_equal_to_the_prefix_reuses_its_full_blocks_and_computes_the_rest():
    kv = KVCacheManager(num_blocks=10, block_size=4, num_seq_slots=0, prefix_token_ids=PREFIX)
    kv.pin_prefix()
    blocks, ops = kv.allocate(list(PREFIX), num_tokens=len(PREFIX) + 2)
    assert blocks.num_cached_tokens == 4 and ops.is_empty  # the last token is always computed
    assert blocks.block_ids[0] == kv.prefix.block_ids[0]


def test_prefix_ending_on_a_block_boundary_needs_no_copy():
    kv = KVCacheManager(num_blocks=10, block_size=4, num_seq_slots=0, prefix_token_ids=PREFIX[:4])
    kv.pin_prefix()
    hit, ops = kv.allocate([*PREFIX[:4], 1], num_tokens=6)
    assert hit.block_ids[0] == kv.prefix.block_ids[0] and not ops.block_copies


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 20), st.booleans()), max_size=40),
       st.booleans())
def test_any_mix_of_allocations_returns_every_block(ops, hybrid):
    """Random allocate/free sequences: no block is owned twice (except the shared prefix), and
    freeing everything restores the initial free count."""
    kv = KVCacheManager(num_blocks=16, block_size=4, num_seq_slots=3 if hybrid else 0,
                        prefix_token_ids=PREFIX, num_snapshot_slots=int(hybrid))
    kv.pin_prefix()
    initial = kv.num_free_blocks
    live = []
    for is_alloc, length, uses_prefix in ops:
        if is_alloc or not live:
            prompt = [*PREFIX, 1] if uses_prefix else [1]
            result = kv.allocate(prompt, len(prompt) + length)
            if result is not None:
                live.append(result[0])
        else:
            kv.free(live.pop(length % len(live)))
        private = [b for kvb in live for b in kvb.block_ids if b not in kv.prefix.block_ids]
        assert len(private) == len(set(private))
        assert kv.num_free_blocks == initial - len(private)
    for kvb in live:
        kv.free(kvb)
    assert kv.num_free_blocks == initial
