"""Scheduler over ints: decode-first packing, batched prefill admission, KV accounting."""

from __future__ import annotations

import random

import pytest
from fake_model import SchedulerHarness, expected_greedy

from sparkinfer_cli.engine.request import RequestStatus


def _decoding(harness: SchedulerHarness, prompts: list[list[int]], max_tokens: int = 50):
    """Adds requests and steps until all of them are decoding."""
    requests = [harness.add(p, max_tokens) for p in prompts]
    while any(r.is_prefilling for r in requests):
        harness.step()
    return requests


def test_many_requests_complete_and_every_block_returns():
    rng = random.Random(0)
    harness = SchedulerHarness(ctx=512, block_size=8, max_batch_tokens=6, max_num_seqs=5,
                               prefill_chunk_tokens=16, prefill_mix_max=24)
    requests = [harness.add([rng.randrange(50) for _ in range(rng.randint(1, 60))],
                            rng.randint(1, 30)) for _ in range(40)]
    harness.run_to_completion()
    for r in requests:
        assert r.status is RequestStatus.FINISHED and r.finish_reason == "length"
        assert r.output_ids == expected_greedy(r.prompt_ids, r.params.max_tokens)
    assert harness.kv.num_free_blocks == harness.initial_free_blocks == 64


def test_continuous_packs_decodes_first_then_one_prefill_joins():
    harness = SchedulerHarness(ctx=1024, sched_policy="continuous")
    decoders = _decoding(harness, [[1, 2], [3, 4, 5], [6]])
    waiting = [harness.add([7] * 10, 5), harness.add([8] * 10, 5)]
    output = harness.step()
    ids = [s.request_id for s in output.sequences]
    assert ids == [r.request_id for r in [*decoders, waiting[0]]]
    assert [len(s.token_ids) for s in output.sequences] == [1, 1, 1, 10]
    assert waiting[1].status is RequestStatus.WAITING


def test_continuous_unbatched_prefills_join_one_per_step():
    harness = SchedulerHarness(ctx=1024, sched_policy="continuous", prefill_batched=False,
                               prefill_chunk_tokens=0)
    decoders = _decoding(harness, [[1, 2], [3, 4, 5]])
    waiting = [harness.add([7] * 10, 5), harness.add([8] * 10, 5)]
    output = harness.step()
    assert [s.request_id for s in output.sequences][-1] == waiting[0].request_id
    assert len(output.sequences) == len(decoders) + 1
    assert waiting[1].status is RequestStatus.WAITING


def test_continuous_admits_requests_arriving_together_one_per_step_in_order():
    rng = random.Random(1)
    harness = SchedulerHarness(ctx=8192, max_num_seqs=64, sched_policy="continuous")
    requests = [harness.add([rng.randrange(50) for _ in range(rng.randint(5, 40))], 40)
                for _ in range(32)]
    for k in range(32):  # step k: the k running requests decode, request k is prefilled
        output = harness.step()
        assert [s.request_id for s in output.sequences][-1] == requests[k].request_id
        assert len(output.sequences) == k + 1
    harness.run_to_completion()
    assert all(r.output_ids == expected_greedy(r.prompt_ids, 40) for r in requests)
    assert harness.kv.num_free_blocks == harness.initial_free_blocks


def test_a_prefill_over_the_mix_limit_runs_when_no_decode_waits():
    harness = SchedulerHarness(ctx=2048, sched_policy="continuous", prefill_mix_max=30)
    long_request, short = harness.add([3] * 50, 3), harness.add([4] * 5, 3)
    assert [len(s.token_ids) for s in harness.step().sequences] == [50]
    assert short.status is RequestStatus.WAITING and not long_request.is_prefilling


def test_chunked_prefill_resumes_before_new_admissions():
    harness = SchedulerHarness(ctx=2048, sched_policy="chunked", prefill_chunk_tokens=16)
    a, b = harness.add([3] * 40, 3), harness.add([4] * 10, 3)
    pieces = [[(s.request_id, len(s.token_ids)) for s in harness.step().sequences]
              for _ in range(4)]
    assert pieces == [[(a.request_id, 16)], [(a.request_id, 16)], [(a.request_id, 8)],
                      [(a.request_id, 1), (b.request_id, 10)]]


def test_admission_stops_when_kv_runs_out():
    harness = SchedulerHarness(ctx=128, block_size=8)  # 16 blocks
    requests = [harness.add([i] * 20, 20) for i in range(4)]  # 5 blocks each
    for _ in range(4):
        harness.step()
    assert [r.status for r in requests].count(RequestStatus.WAITING) == 1
    assert requests[3].status is RequestStatus.WAITING
    harness.run_to_completion()
    assert all(r.output_ids == expected_greedy(r.prompt_ids, 20) for r in requests)
    assert harness.kv.num_free_blocks == 16


@pytest.mark.parametrize("policy", ["continuous", "chunked", "priority"])
def test_steps_never_exceed_the_models_pass_limit(policy):
    rng = random.Random(2)
    harness = SchedulerHarness(ctx=4096, sched_policy=policy, max_step_tokens=24,
                               prefill_chunk_tokens=0, prefill_mix_max=0, max_batch_tokens=8)
    requests = [harness.add([rng.randrange(50) for _ in range(rng.randint(1, 70))], 6)
                for _ in range(12)]
    harness.run_to_completion()  # the harness checks every step against max_step_tokens
    assert all(r.output_ids == expected_greedy(r.prompt_ids, 6) for r in requests)


def test_priority_admits_prefills_in_priority_order():
    harness = SchedulerHarness(ctx=2048, sched_policy="priority")
    low, high, mid = (harness.add([i] * 4, 2, priority=p) for i, p in [(1, 0), (2, 9), (3, 5)])
    firsts = [harness.step().sequences[-1].request_id for _ in range(3)]
    assert firsts == [high.request_id, mid.request_id, low.request_id]


def test_decode_budget_rotates_over_running_requests():
    # priority: prefills run exclusively, so a third request gets in despite the full budget
    harness = SchedulerHarness(ctx=1024, max_batch_tokens=2, sched_policy="priority")
    decoders = _decoding(harness, [[1], [2], [3]])
    counts = {r.request_id: 0 for r in decoders}
    for _ in range(15):
        output = harness.step()
        assert len(output.sequences) == 2
        for seq in output.sequences:
            counts[seq.request_id] += 1
    assert max(counts.values()) - min(counts.values()) <= 1


def test_full_decode_budget_admits_no_prefill():
    harness = SchedulerHarness(ctx=1024, max_batch_tokens=2)
    _decoding(harness, [[1], [2]])
    waiting = harness.add([3, 4], 5)
    output = harness.step()
    assert len(output.sequences) == 2 and waiting.status is RequestStatus.WAITING


def test_request_waits_until_kv_blocks_free_up():
    harness = SchedulerHarness(ctx=64, block_size=8)  # 8 blocks
    first = harness.add([1] * 20, 20)  # 40 positions → 5 blocks
    second = harness.add([2] * 20, 20)
    harness.step()
    assert first.status is RequestStatus.RUNNING and second.status is RequestStatus.WAITING
    while not first.is_finished:
        harness.step()
        if not first.is_finished:
            assert second.status is RequestStatus.WAITING
    harness.step()
    assert second.status is RequestStatus.RUNNING
    harness.run_to_completion()
    assert harness.kv.num_free_blocks == 8


def test_max_num_seqs_bounds_running_requests():
    harness = SchedulerHarness(ctx=1024, max_num_seqs=2)
    requests = [harness.add([i], 3) for i in range(4)]
    for _ in range(3):
        harness.step()
    assert [r.status for r in requests[2:]] == [RequestStatus.WAITING] * 2
    harness.run_to_completion()
    assert all(r.is_finished for r in requests)


def test_continuous_long_prefill_waits_for_decodes_to_drain():
    harness = SchedulerHarness(ctx=1024, sched_policy="continuous", prefill_mix_max=8)
    (decoder,) = _decoding(harness, [[1, 2]], max_tokens=4)
    long_request = harness.add([3] * 9, 2)
    while not decoder.is_finished:
        assert long_request.status is RequestStatus.WAITING
        harness.step()
    output = harness.step()
    assert [len(s.token_ids) for s in output.sequences] == [9]


def test_short_prefill_mixes_with_decodes():
    harness = SchedulerHarness(ctx=1024, prefill_mix_max=8)
    _decoding(harness, [[1, 2]])
    short = harness.add([3] * 8, 2)
    output = harness.step()
    assert [s.request_id for s in output.sequences][-1] == short.request_id


def test_prefix_hit_prefills_only_the_suffix():
    prefix = tuple(range(10, 30))  # 20 tokens, block_size 8
    harness = SchedulerHarness(ctx=256, block_size=8, prefix_token_ids=prefix)
    request = harness.add([*prefix, 1, 2, 3], 4)
    output = harness.step()
    (seq,) = output.sequences
    assert seq.start_position == 20 and seq.token_ids == [1, 2, 3]
    assert seq.block_ids[:2] == harness.kv.prefix.block_ids[:2]
    assert output.cache_ops.block_copies == [(harness.kv.prefix.block_ids[2], seq.block_ids[2])]
    harness.run_to_completion()
    assert request.output_ids == expected_greedy(request.prompt_ids, 4)
    assert harness.kv.num_free_blocks == harness.initial_free_blocks


def test_finish_mid_prefill_mid_decode_and_while_queued_frees_everything():
    harness = SchedulerHarness(ctx=256, block_size=8, prefill_batched=False,
                               prefill_chunk_tokens=4, prefix_token_ids=(9, 9, 9))
    decoding = _decoding(harness, [[1, 2], [9, 9, 9, 5]])
    prefilling = harness.add([3] * 20, 8)
    queued = harness.add([4] * 20, 8)
    harness.step()
    assert prefilling.status is RequestStatus.RUNNING and prefilling.is_prefilling
    for request in [*decoding, prefilling, queued]:
        harness.scheduler.finish(request, "abort")
        assert request.finish_reason == "abort" and request.kv is None
    assert not harness.scheduler.has_unfinished
    assert harness.kv.num_free_blocks == harness.initial_free_blocks


def test_finish_twice_is_harmless():
    harness = SchedulerHarness(ctx=256)
    request = harness.add([1], 5)
    harness.step()
    harness.scheduler.finish(request, "abort")
    harness.scheduler.finish(request, "timeout")
    assert request.finish_reason == "abort" and harness.kv.num_free_blocks == 16
