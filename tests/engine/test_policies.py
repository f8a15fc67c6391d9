"""The three policies: ordering of the waiting queue and the size of the step's prefill piece."""

from __future__ import annotations

import pytest
from fake_model import SchedulerHarness, expected_greedy

from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.engine.policy import (
    BatchedPolicy,
    ChunkedPolicy,
    ContinuousPolicy,
    PriorityPolicy,
    create_policy,
)
from sparkinfer_cli.engine.request import RequestStatus


def _prefill_pieces(harness: SchedulerHarness, request) -> list[tuple[int, int]]:
    """(prefill tokens, decodes beside it) of each step until the request's prompt is done."""
    pieces = []
    while request.is_prefilling or request.status is RequestStatus.WAITING:
        output = harness.step()
        mine = [len(s.token_ids) for s in output.sequences if s.request_id == request.request_id]
        if mine:
            pieces.append((mine[0], len(output.sequences) - 1))
    return pieces


def _with_decoder(sched_policy: str, prefill_chunk_tokens: int = 16, **kwargs) -> SchedulerHarness:
    harness = SchedulerHarness(ctx=2048, sched_policy=sched_policy,
                               prefill_chunk_tokens=prefill_chunk_tokens, **kwargs)
    decoder = harness.add([1, 2], 100)
    harness.step()
    assert not decoder.is_prefilling
    return harness


@pytest.mark.parametrize("name, cls", [("batched", BatchedPolicy), ("continuous", ContinuousPolicy),
                                       ("chunked", ChunkedPolicy), ("priority", PriorityPolicy)])
def test_create_policy(name, cls):
    assert type(create_policy(EngineConfig(sched_policy=name))) is cls


def test_default_policy_is_batched():
    assert EngineConfig().sched_policy == "batched"


def test_batched_prompts_share_a_step_up_to_its_token_budget():
    harness = _with_decoder("batched", step_tokens=30)
    a, b, c = harness.add([3] * 12, 4), harness.add([4] * 12, 4), harness.add([5] * 12, 4)
    output = harness.step()  # 1 decode + 12 + 12 + the first 5 of c
    assert [(s.request_id, len(s.token_ids)) for s in output.sequences[1:]] == \
        [(a.request_id, 12), (b.request_id, 12), (c.request_id, 5)]
    assert not a.is_prefilling and not b.is_prefilling and c.is_prefilling


def test_batched_long_prompt_advances_in_budget_pieces_while_decodes_stream():
    harness = _with_decoder("batched", step_tokens=16)
    assert _prefill_pieces(harness, harness.add([3] * 40, 4)) == [(15, 1), (15, 1), (10, 1)]


def test_batched_ignores_the_mix_limit():
    harness = _with_decoder("batched", step_tokens=64, prefill_mix_max=8)
    assert _prefill_pieces(harness, harness.add([3] * 40, 4)) == [(40, 1)]


def test_batched_admits_no_request_out_of_order_when_kv_runs_out():
    harness = SchedulerHarness(ctx=128, block_size=8, sched_policy="batched")  # 16 blocks
    first, big, small = harness.add([1] * 20, 20), harness.add([2] * 90, 10), harness.add([3], 2)
    harness.step()  # big needs 13 blocks of the 11 left: it waits, and small waits behind it
    assert first.status is RequestStatus.RUNNING
    assert big.status is small.status is RequestStatus.WAITING
    harness.run_to_completion()
    assert small.output_ids == expected_greedy([3], 2)


def test_continuous_batched_prefill_runs_whole_beside_decodes():
    harness = _with_decoder("continuous")
    assert _prefill_pieces(harness, harness.add([3] * 40, 4)) == [(40, 1)]


def test_continuous_unbatched_prefill_advances_in_chunks():
    harness = _with_decoder("continuous", prefill_batched=False)
    assert _prefill_pieces(harness, harness.add([3] * 40, 4)) == [(16, 1), (16, 1), (8, 1)]


def test_chunked_prefill_advances_in_chunks_beside_decodes():
    harness = _with_decoder("chunked")  # chunked chunks whatever prefill_batched says
    assert _prefill_pieces(harness, harness.add([3] * 40, 4)) == [(16, 1), (16, 1), (8, 1)]


def test_chunked_without_chunk_limit_obeys_mix_max():
    harness = _with_decoder("chunked", prefill_chunk_tokens=0, prefill_mix_max=30)
    request = harness.add([3] * 40, 4)
    assert _prefill_pieces(harness, request) == [(40, 0)]  # waited for the decoder to finish


def test_priority_prefill_runs_alone():
    harness = _with_decoder("priority")
    assert _prefill_pieces(harness, harness.add([3] * 40, 4)) == [(40, 0)]
    output = harness.step()
    assert [len(s.token_ids) for s in output.sequences] == [1, 1]  # decodes resume after it


def test_priority_orders_waiting_requests_fifo_among_equals():
    harness = SchedulerHarness(ctx=2048, sched_policy="priority")
    low, high_a, high_b, mid = (harness.add([i], 2, priority=p)
                                for i, p in [(1, 0), (2, 5), (3, 5), (4, 1)])
    admitted = []
    for _ in range(4):
        output = harness.step()
        admitted += [s.request_id for s in output.sequences if s.start_position == 0]
    assert admitted == [high_a.request_id, high_b.request_id, mid.request_id, low.request_id]


def test_fifo_policies_ignore_priority():
    harness = SchedulerHarness(ctx=2048, sched_policy="continuous", max_num_seqs=1)
    first, second = harness.add([1], 1, priority=0), harness.add([2], 1, priority=9)
    harness.step()
    assert first.is_finished and second.status is RequestStatus.WAITING


@pytest.mark.parametrize("policy", ["batched", "continuous", "chunked", "priority"])
@pytest.mark.parametrize("batched", [True, False])
def test_every_policy_completes_a_mixed_load(policy, batched):
    harness = SchedulerHarness(ctx=1024, block_size=8, sched_policy=policy, max_batch_tokens=4,
                               prefill_chunk_tokens=8, prefill_mix_max=12, prefill_batched=batched,
                               max_num_seqs=6)
    requests = [harness.add([(i * 7 + j) % 50 for j in range(1 + (i * 13) % 40)], 1 + i % 9,
                            priority=i % 3) for i in range(25)]
    harness.run_to_completion()
    assert all(r.output_ids == expected_greedy(r.prompt_ids, r.params.max_tokens) for r in requests)
    assert harness.kv.num_free_blocks == harness.initial_free_blocks
