"""ContinuousBatchEngine end to end on its real thread, with FakeModel (oracle: expected_greedy)
and with the tiny qwen3 GGUF fixture (oracle: the llama.cpp / transformers greedy goldens)."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from engine_harness import TOKENIZER, WAIT_S, Collector, greedy, wait_idle
from fake_model import (
    EOS_ID,
    N_VOCAB,
    FakeDeviceModel,
    FakeModel,
    eos_first,
    expected_greedy,
)

from sparkinfer_cli.engine.config import (
    EngineConfig,
    EngineStoppedError,
    QueueFullError,
    RequestTooLargeError,
)
from sparkinfer_cli.engine.engine import ContinuousBatchEngine, RequestEvent
from sparkinfer_cli.engine.sampling_params import SamplingParams

PREFIX = tuple(range(20))  # 20 tokens: 2 full blocks of 8 + a partial one


def _prompts(n: int, prefix: tuple[int, ...] = ()) -> list[list[int]]:
    return [[*prefix, *[(7 * i + j) % (N_VOCAB - 2) for j in range(1 + (5 * i) % 23)]]
            for i in range(n)]


@pytest.mark.parametrize("model_class", [FakeModel, FakeDeviceModel])
@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("policy", ["continuous", "chunked", "priority"])
def test_concurrent_requests_match_their_solo_outputs(engines, hybrid, policy, model_class):
    """FakeDeviceModel: the all-decode steps run as several passes (decode_greedy)."""
    model = model_class(hybrid=hybrid)
    engine = engines(model, start=False, sched_policy=policy, max_batch_tokens=8,
                     prefill_chunk_tokens=8, prefill_mix_max=16, max_num_seqs=12)
    sink, prompts = Collector(), _prompts(24)
    ids = [engine.submit(p, greedy(1 + i % 17), sink, priority=i % 3)
           for i, p in enumerate(prompts)]
    initial_free = engine.stats().free_kv_blocks
    engine.start()  # every request is queued before the first step: batches are full
    for request_id, prompt, i in zip(ids, prompts, range(len(ids))):
        final = sink.final(request_id)
        assert final.finish_reason == "length" and final.error is None
        assert sink.tokens(request_id) == expected_greedy(prompt, 1 + i % 17)
    assert max(model.batch_sizes) > 1
    wait_idle(engine)
    assert engine.stats().free_kv_blocks == initial_free == engine.stats().total_kv_blocks


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_batch_invariant_model_gets_no_pass_beyond_its_limit(engines, hybrid):
    """A model in its batch-invariant mode (invariant_pass_tokens: CudaModel under
    SPARKINFER_BATCH_INVARIANT) never gets a pass of more tokens, whatever the step budget:
    prompts arrive in pieces of up to that many tokens, decodes take turns, the answers are
    unchanged."""
    model = FakeDeviceModel(hybrid=hybrid)
    model.invariant_pass_tokens = 5
    passes: list[int] = []
    model.before_forward = lambda batch: passes.append(len(batch.token_ids))
    engine = engines(model, start=False, max_num_seqs=8)
    sink, prompts = Collector(), _prompts(10)
    ids = [engine.submit(p, greedy(6), sink) for p in prompts]
    engine.start()
    for request_id, prompt in zip(ids, prompts):
        assert sink.tokens(sink.final(request_id).request_id) == expected_greedy(prompt, 6)
    assert max(passes) == 5


def test_submissions_from_many_threads(engines):
    engine, sink = engines(), Collector()
    prompts, ids = _prompts(32), [None] * 32

    def submit(i: int) -> None:
        ids[i] = engine.submit(prompts[i], greedy(6), sink)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 32
    for request_id, prompt in zip(ids, prompts):
        sink.final(request_id)
        assert sink.tokens(request_id) == expected_greedy(prompt, 6)


def test_events_carry_text_counts_and_timestamps(engines):
    engine, sink = engines(), Collector()
    request_id = engine.submit([0, 52, 53, 1], greedy(12, logprobs=True, top_logprobs=2), sink)
    final = sink.final(request_id)
    events = sink.events[request_id]
    output = expected_greedy([0, 52, 53, 1], 12)
    assert sink.tokens(request_id) == output
    assert sink.text(request_id) == TOKENIZER.decode(output)
    assert [e.num_output_tokens for e in events] == list(range(1, 13))
    assert all(e.num_prompt_tokens == 4 and len(e.logprobs) == len(e.token_ids) for e in events)
    assert [lp.token_id for e in events for lp in e.logprobs] == output
    assert final.submitted_at <= final.scheduled_at <= final.first_token_at <= final.finished_at
    assert all(e.finished_at is None for e in events[:-1])


def test_incomplete_utf8_is_held_back():
    """The two byte tokens of "é": the first event has no text, the second has all of it."""
    from sparkinfer_cli.engine.request import OutputStream
    from sparkinfer_cli.engine.stop import StopStringMatcher
    from sparkinfer_cli.tokenizer.detokenizer import IncrementalDetokenizer

    stream = OutputStream(IncrementalDetokenizer(TOKENIZER), StopStringMatcher(()), {EOS_ID})
    first_half, second_half = 52, 53  # the two bytes of "é"
    assert TOKENIZER.decode([first_half, second_half]) == "é"
    assert stream.push(_sample(first_half), False) is None and stream.take()[1] == ""
    assert stream.push(_sample(second_half), False) is None and stream.take()[1] == "é"


def _sample(token_id: int):
    from sparkinfer_cli.engine.sampler import SampleResult

    return SampleResult(token_id, None)


def test_end_of_generation_token_stops_unless_ignored(engines):
    engine, sink = engines(), Collector()
    eos_first = greedy(10, logit_bias={EOS_ID: 50.0})
    stopped = engine.submit([1, 2], eos_first, sink)
    final = sink.final(stopped)
    assert final.finish_reason == "stop" and sink.tokens(stopped) == [EOS_ID]
    assert sink.text(stopped) == ""  # the end-of-generation token has no text
    ignored = engine.submit([1, 2], greedy(10, logit_bias={EOS_ID: 50.0}, ignore_eos=True), sink)
    assert sink.final(ignored).finish_reason == "length" and sink.tokens(ignored) == [EOS_ID] * 10


@pytest.mark.parametrize("model_class", [FakeModel, FakeDeviceModel])
def test_min_tokens_holds_back_the_end_of_generation_token(engines, model_class):
    """FakeModel: the host's GreedyBatch picks the argmax once the ban is over; FakeDeviceModel:
    the device does, and must not while the ban lasts."""
    engine, sink = engines(eos_first(model_class)), Collector()
    prompt = [1, 2]
    plain = engine.submit(prompt, greedy(20), sink)
    assert sink.final(plain).finish_reason == "stop" and sink.tokens(plain) == [EOS_ID]
    held = engine.submit(prompt, greedy(20, min_tokens=5), sink)
    assert sink.final(held).finish_reason == "stop"
    assert sink.tokens(held) == expected_greedy(prompt, 5) + [EOS_ID]
    full = engine.submit(prompt, greedy(20, ignore_eos=True, min_tokens=5), sink)
    assert sink.final(full).finish_reason == "length" and sink.tokens(full) == [EOS_ID] * 20
    capped = engine.submit(prompt, greedy(3, min_tokens=5), sink)
    assert sink.final(capped).finish_reason == "length"
    assert sink.tokens(capped) == expected_greedy(prompt, 3)


def test_min_tokens_ignores_stop_strings_completed_within_them(engines):
    engine, sink = engines(), Collector()
    prompt = [3, 30, 4]
    output = expected_greedy(prompt, 12)
    stop = TOKENIZER.decode(output[1:3])  # " il": only in the text of tokens 2 and 3
    stopped = engine.submit(prompt, greedy(12, stop=(stop,)), sink)
    assert sink.final(stopped).finish_reason == "stop"
    held = engine.submit(prompt, greedy(12, stop=(stop,), min_tokens=4), sink)
    assert sink.final(held).finish_reason == "length" and sink.tokens(held) == output
    assert sink.text(held) == TOKENIZER.decode(output)


@pytest.mark.parametrize("model_class", [FakeModel, FakeDeviceModel])
def test_stop_token_ids_and_stop_strings(engines, model_class):
    """FakeDeviceModel: the stops fall inside a run of decode passes; the later passes' tokens
    are dropped."""
    engine, sink = engines(model_class()), Collector()
    prompt = [3, 30, 4]
    output = expected_greedy(prompt, 20)
    by_id = engine.submit(prompt, greedy(20, stop_token_ids=(output[4],)), sink)
    assert sink.final(by_id).finish_reason == "stop"
    assert sink.tokens(by_id) == output[:output.index(output[4]) + 1]
    text = TOKENIZER.decode(output)
    stop = text[6:9]
    by_text = engine.submit(prompt, greedy(20, stop=(stop,)), sink)
    assert sink.final(by_text).finish_reason == "stop"
    assert sink.text(by_text) == text[:text.index(stop)]


def test_max_tokens_is_capped_by_max_output_tokens(engines):
    engine, sink = engines(max_output_tokens=5), Collector()
    request_id = engine.submit([1, 2, 3], greedy(100), sink)
    assert sink.final(request_id).finish_reason == "length"
    assert sink.tokens(request_id) == expected_greedy([1, 2, 3], 5)


def test_request_larger_than_the_context_is_refused_at_submit(engines):
    engine, sink = engines(ctx=64), Collector()
    assert engine.max_context == 64
    with pytest.raises(RequestTooLargeError, match=r"60 prompt tokens.*max_tokens 10.*64"):
        engine.submit([1] * 60, greedy(10), sink)
    fits = engine.submit([1] * 54, greedy(10), sink)  # exactly the context
    assert sink.final(fits).finish_reason == "length" and len(sink.tokens(fits)) == 10
    wait_idle(engine)
    assert engine.stats().free_kv_blocks == 8


def test_requests_wait_for_kv_and_all_complete(engines):
    engine, sink = engines(ctx=64), Collector()  # room for one request at a time
    ids = [engine.submit(p, greedy(30), sink) for p in _prompts(5)]
    for request_id, prompt in zip(ids, _prompts(5)):
        assert sink.final(request_id).finish_reason == "length"
        assert sink.tokens(request_id) == expected_greedy(prompt, 30)
    wait_idle(engine)
    assert engine.stats().free_kv_blocks == 8


@pytest.mark.parametrize("hybrid", [False, True])
def test_configured_prefix_alone_prefills_only_the_suffix(engines, hybrid):
    """The seed's behaviour (automatic caching off): only the configured prefix is reused."""
    model = FakeModel(hybrid=hybrid)
    engine, sink = engines(model, prefix_token_ids=PREFIX, prefix_cache=False), Collector()
    assert model.num_forward_tokens == len(PREFIX)  # warmed once at start
    initial_free = engine.stats().free_kv_blocks
    assert initial_free == engine.stats().total_kv_blocks - 3
    hits, misses = _prompts(10, PREFIX), [[40, *PREFIX, 1]]
    whole = list(PREFIX)  # its full blocks are reused; the rest, at least one token, is computed
    ids = [engine.submit(p, greedy(4), sink) for p in [*hits, *misses, whole]]
    for request_id, prompt in zip(ids, [*hits, *misses, whole]):
        assert sink.final(request_id).finish_reason == "length"
        assert sink.tokens(request_id) == expected_greedy(prompt, 4)
    computed = len(PREFIX) + sum(len(p) - len(PREFIX) for p in hits) + \
        sum(len(p) for p in misses) + 3 * len(ids) + \
        (len(PREFIX) - (0 if hybrid else (len(PREFIX) - 1) // 8 * 8))
    assert model.num_forward_tokens == computed
    wait_idle(engine)
    assert engine.stats().free_kv_blocks == initial_free


def test_queue_depth_overflow_is_refused_before_allocation(engines):
    release = threading.Event()
    model = FakeModel()
    model.before_forward = lambda batch: release.wait(WAIT_S)
    engine, sink = engines(model, max_queue_depth=2), Collector()
    first, second = (engine.submit([i], greedy(3), sink) for i in (1, 2))
    free = engine.stats().free_kv_blocks
    with pytest.raises(QueueFullError, match="max_queue_depth=2"):
        engine.submit([3], greedy(3), sink)
    assert engine.stats().free_kv_blocks == free
    release.set()
    sink.final(first), sink.final(second)
    third = engine.submit([3], greedy(3), sink)
    assert sink.final(third).finish_reason == "length"


def test_stats_count_active_and_queued_requests(engines):
    entered, release = threading.Event(), threading.Event()
    model = FakeModel()

    def block(batch) -> None:
        entered.set()
        release.wait(WAIT_S)

    model.before_forward = block
    engine, sink = engines(model, max_num_seqs=1, max_queue_depth=5), Collector()
    ids = [engine.submit([i], greedy(2), sink) for i in (1, 2, 3)]
    assert entered.wait(WAIT_S)
    stats = engine.stats()
    assert (stats.active_requests, stats.queued_requests) == (1, 2)
    assert stats.total_kv_blocks == 128 and stats.free_kv_blocks == 127
    assert stats.max_queue_depth == 5 and stats.accepting_requests
    release.set()
    for request_id in ids:
        sink.final(request_id)


def test_abort_mid_decode_mid_prefill_and_while_queued(engines):
    model = FakeModel()
    engine = engines(model, prefill_batched=False, prefill_chunk_tokens=4, max_num_seqs=2,
                     prefix_token_ids=PREFIX)
    sink = Collector()
    initial_free = engine.stats().free_kv_blocks
    ids: list[str] = []
    others_submitted = threading.Event()

    def abort_at_second_prefill_chunk(batch) -> None:
        if ids and sink.events[ids[0]]:  # the first request decodes only once the others are queued
            assert others_submitted.wait(WAIT_S)
        if 4 in batch.start_positions:  # positions 4..7 of the 40-token prompt
            for request_id in ids:
                engine.abort(request_id)

    model.before_forward = abort_at_second_prefill_chunk
    ids.append(engine.submit([*PREFIX, 1], greedy(200), sink))
    while not sink.events[ids[0]]:
        time.sleep(0.001)
    ids += [engine.submit([2] * 40, greedy(200), sink), engine.submit([3] * 10, greedy(200), sink)]
    others_submitted.set()
    decoding, prefilling, queued = (sink.final(i) for i in ids)
    assert [e.finish_reason for e in (decoding, prefilling, queued)] == ["abort"] * 3
    assert decoding.num_output_tokens > 1
    assert prefilling.num_output_tokens == 0 and prefilling.scheduled_at is not None
    assert queued.scheduled_at is None
    wait_idle(engine)
    assert engine.stats().free_kv_blocks == initial_free
    engine.abort("no-such-request")  # unknown ids are ignored


@pytest.mark.parametrize("model_class", [FakeModel, FakeDeviceModel])
@pytest.mark.parametrize("hybrid", [False, True])
def test_random_mix_of_outcomes_returns_every_block_and_slot(engines, hybrid, model_class):
    """Finished, stopped, aborted (queued, mid-prefill, mid-decode) and failed requests, with and
    without the prefix: one final event each, correct tokens, and all KV back at the end."""
    rng = random.Random(7)
    model = model_class(hybrid=hybrid)
    model.fail_on_token = 50
    engine = engines(model, start=False, ctx=512, prefix_token_ids=PREFIX, max_num_seqs=6,
                     prefill_batched=False, prefill_chunk_tokens=8, max_batch_tokens=4)
    sink, abort_after, prompts = Collector(), {}, {}

    def on_event(event: RequestEvent) -> None:
        sink(event)
        if event.finish_reason is None and event.num_output_tokens >= abort_after[event.request_id]:
            engine.abort(event.request_id)

    for i in range(40):
        prompt = [rng.randrange(48) for _ in range(rng.randint(1, 30))]
        prompt = [*PREFIX, *prompt] if rng.random() < 0.5 else prompt
        prompt += [50] if rng.random() < 0.1 else []
        request_id = engine.submit(prompt, greedy(rng.randint(1, 20)), on_event)
        abort_after[request_id] = rng.choice([0, 1, 3, 1000])  # 0: abort at submit
        prompts[request_id] = prompt
        if abort_after[request_id] == 0:
            engine.abort(request_id)
    initial_free = engine.stats().free_kv_blocks
    engine.start()
    outcomes = defaultdict(int)
    for request_id, prompt in prompts.items():
        final = sink.final(request_id)
        outcomes[final.finish_reason] += 1
        assert sum(e.finish_reason is not None for e in sink.events[request_id]) == 1
        tokens = sink.tokens(request_id)
        assert tokens == expected_greedy(prompt, len(tokens))
    assert set(outcomes) == {"length", "abort", "error"}
    wait_idle(engine)
    assert engine.stats().free_kv_blocks == initial_free
    assert engine.kv.slot_pool.num_free_slots == (6 if hybrid else 0)


def test_abort_from_the_event_callback(engines):
    engine, sink = engines(), Collector()

    def on_event(event: RequestEvent) -> None:
        sink(event)
        if event.num_output_tokens == 3 and event.finish_reason is None:
            engine.abort(event.request_id)

    request_id = engine.submit([1, 2], greedy(1000), on_event)
    final = sink.final(request_id)
    assert final.finish_reason == "abort" and final.num_output_tokens == 3
    assert sink.tokens(request_id) == expected_greedy([1, 2], 3)


def test_timeout_finishes_running_and_queued_requests(engines):
    model = FakeModel()
    model.before_forward = lambda batch: time.sleep(0.005)
    engine, sink = engines(model, ctx=64, request_timeout_s=0.1), Collector()
    running = engine.submit([1] * 10, greedy(50), sink)
    queued = engine.submit([2] * 10, greedy(50), sink)  # no KV left until `running` ends
    for request_id in (running, queued):
        final = sink.final(request_id)
        assert final.finish_reason == "timeout" and final.error
        assert final.finished_at - final.submitted_at >= 0.1
    wait_idle(engine)
    assert engine.stats().free_kv_blocks == 8


def test_model_failure_ends_its_requests_and_the_engine_goes_on(engines):
    model = FakeModel()
    model.fail_on_token = 33
    engine, sink = engines(model), Collector()
    failed = engine.submit([1, 33], greedy(5), sink)
    final = sink.final(failed)
    assert final.finish_reason == "error" and "injected model failure" in final.error
    fine = engine.submit([1, 2], greedy(5), sink)
    assert sink.final(fine).finish_reason == "length"
    wait_idle(engine)
    assert engine.stats().free_kv_blocks == engine.stats().total_kv_blocks


def test_a_request_that_bans_every_token_is_rejected_and_the_engine_goes_on(engines):
    engine, sink = engines(), Collector()
    banned = engine.submit([1, 2], greedy(5, logit_bias=dict.fromkeys(range(N_VOCAB), -100.0)),
                           sink)
    final = sink.final(banned)
    assert final.finish_reason == "rejected" and "banned" in final.error
    fine = engine.submit([1, 2], greedy(5), sink)
    assert sink.final(fine).finish_reason == "length"
    wait_idle(engine)
    assert engine.stats().free_kv_blocks == engine.stats().total_kv_blocks


def test_failing_callback_aborts_only_its_request(engines):
    engine, sink = engines(), Collector()

    def broken(event: RequestEvent) -> None:
        raise RuntimeError("consumer went away")

    engine.submit([1, 2], greedy(50), broken)
    healthy = engine.submit([3, 4], greedy(20), sink)
    assert sink.final(healthy).finish_reason == "length"
    wait_idle(engine)
    assert engine.stats().free_kv_blocks == engine.stats().total_kv_blocks


def test_abort_waiting_ends_the_queued_requests_and_lets_the_running_one_finish(engines):
    model = FakeModel()
    model.before_forward = lambda batch: time.sleep(0.005)
    engine, sink = engines(model, ctx=64), Collector()
    running = engine.submit([1] * 10, greedy(30), sink)  # 5 of the 8 KV blocks
    while not sink.events[running]:
        time.sleep(0.001)
    queued = [engine.submit([2] * 10, greedy(30), sink) for _ in range(2)]  # wait for KV
    engine.abort_waiting()
    for request_id in queued:
        final = sink.final(request_id)
        assert final.finish_reason == "abort" and final.num_output_tokens == 0
        assert final.scheduled_at is None
    assert sink.final(running).finish_reason == "length"
    assert len(sink.tokens(running)) == 30
    later = engine.submit([3] * 10, greedy(2), sink)  # the abort applied once, not for good
    assert sink.final(later).finish_reason == "length"


def test_shutdown_finishes_in_flight_requests_and_refuses_new_ones(engines):
    engine, sink = engines(), Collector()
    ids = [engine.submit(p, greedy(20), sink) for p in _prompts(6)]
    engine.shutdown(wait=True)
    assert all(sink.events[i][-1].finish_reason == "length" for i in ids)
    assert not engine._thread.is_alive()
    stats = engine.stats()
    assert not stats.accepting_requests and stats.active_requests == stats.queued_requests == 0
    with pytest.raises(EngineStoppedError):
        engine.submit([1], greedy(1), sink)


def test_prefix_outside_the_vocabulary_is_a_config_error():
    with pytest.raises(ValueError, match="prefix token ids"):
        ContinuousBatchEngine(FakeModel(), TOKENIZER, EngineConfig(prefix_token_ids=(N_VOCAB,)))


@pytest.mark.parametrize("config, match", [
    ({"sched_policy": "fifo"}, "sched_policy"),
    ({"ctx": 64, "block_size": 16, "prefix_token_ids": tuple(range(49))}, "prefix"),
    ({"max_batch_tokens": 0}, "max_batch_tokens"),
    ({"request_timeout_s": -1.0}, "request_timeout_s"),
])
def test_invalid_configs(config, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**config)


@pytest.mark.parametrize("prompt, params, match", [
    ([], greedy(1), "at least one token"),
    ([1, N_VOCAB], greedy(1), "token ids"),
])
def test_invalid_submissions(engines, prompt, params, match):
    engine = engines()
    with pytest.raises(ValueError, match=match):
        engine.submit(prompt, params, Collector())


def test_duplicate_request_id_is_refused(engines):
    release = threading.Event()
    model = FakeModel()
    model.before_forward = lambda batch: release.wait(WAIT_S)
    engine, sink = engines(model), Collector()
    engine.submit([1], greedy(2), sink, request_id="chat-1")
    with pytest.raises(ValueError, match="already in flight"):
        engine.submit([1], greedy(2), sink, request_id="chat-1")
    release.set()
    sink.final("chat-1")


class GraphModel(FakeModel):
    """A FakeModel with CudaModel's decode-graph hook and a pass limit; records when it runs."""

    max_pass_tokens = 12

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, object]] = []

    def prepare(self, cache, max_seqs: int, max_pass_tokens: int) -> None:
        self.calls.append(("capture", (cache, max_seqs, max_pass_tokens)))

    def forward(self, batch, cache):
        self.calls.append(("forward", batch.num_seqs))
        assert len(batch.token_ids) <= self.max_pass_tokens
        return super().forward(batch, cache)


def test_graphs_are_captured_once_before_serving(engines):
    model = GraphModel()
    engine = engines(model, start=False, max_num_seqs=24, prefix_token_ids=PREFIX)
    assert model.calls == []  # nothing runs before start()
    engine.start()
    # before the prefix warm-up, up to the largest pass the scheduler forms (the model's limit)
    assert model.calls[0] == ("capture", (engine.runner.cache, 24, GraphModel.max_pass_tokens))
    sink, prompts = Collector(), _prompts(16)
    ids = [engine.submit(p, greedy(5), sink) for p in prompts]
    for request_id, prompt in zip(ids, prompts):
        sink.final(request_id)
        assert sink.tokens(request_id) == expected_greedy(prompt, 5)
    assert [kind for kind, _ in model.calls].count("capture") == 1


def test_models_without_graphs_start_as_before(engines):
    model = FakeModel()  # ModelBackend.prepare: nothing to capture
    engine, sink = engines(model), Collector()
    assert sink.final(engine.submit([1, 2], greedy(3), sink)).finish_reason == "length"


def test_long_prompts_are_split_to_the_models_pass_limit(engines):
    engine, sink = engines(GraphModel()), Collector()
    prompts = [[(3 * i + j) % 50 for j in range(30)] for i in range(4)]  # 30 > 12 tokens a pass
    ids = [engine.submit(p, greedy(4), sink) for p in prompts]
    for request_id, prompt in zip(ids, prompts):
        assert sink.tokens(sink.final(request_id).request_id) == expected_greedy(prompt, 4)


def test_step_timings_split_forward_from_engine_time(engines):
    model, forward_s = FakeModel(), 0.004
    model.before_forward = lambda batch: time.sleep(forward_s)
    model.clock = None  # the engine's own clock: this test times it
    engine, sink = engines(model), Collector()
    ids = [engine.submit(p, greedy(6), sink) for p in _prompts(3)]
    for request_id in ids:
        sink.final(request_id)
    wait_idle(engine)
    timings = engine.stats().step_timings
    steps = timings.steps["decode"] + timings.steps["mixed"]
    assert steps == len(model.batch_sizes) and timings.steps["decode"] >= 5
    assert timings.steps["mixed"] >= 1  # the prefills
    for kind in ("decode", "mixed"):
        assert forward_s * timings.steps[kind] <= timings.forward_s[kind] <= timings.step_s[kind]
    overhead = timings.overhead_fraction("decode")
    assert overhead == pytest.approx(1 - timings.forward_s["decode"] / timings.step_s["decode"])
    assert 0 < overhead < 1


def test_step_trace_writes_each_step_as_it_ran(engines, tmp_path):
    trace = tmp_path / "steps.jsonl"
    model = FakeModel()
    model.clock = None  # the engine's own clock, which the trace's step times also read
    engine, sink = engines(model, step_trace=str(trace)), Collector()
    prompts = _prompts(3)
    ids = [engine.submit(p, greedy(5), sink) for p in prompts]
    for request_id in ids:
        sink.final(request_id)
    wait_idle(engine)
    engine.shutdown(wait=True)  # the last step's line follows its events
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    timings = engine.stats().step_timings
    assert len(steps) == timings.steps["decode"] + timings.steps["mixed"]
    assert sum(s["prefill_tokens"] for s in steps) == sum(len(p) for p in prompts if len(p) > 1)
    assert sum(s["decodes"] * s["passes"] for s in steps) >= 3 * 4  # tokens after the first
    assert all(s["kind"] == ("mixed" if s["prefills"] else "decode") for s in steps)
    assert [s["t"] for s in steps] == sorted(s["t"] for s in steps)
    assert all(0 <= s["forward_ms"] <= s["step_ms"] and s["cpu_ms"] >= 0 for s in steps)


# ---- the real tiny model ------------------------------------------------------------------------
TINY = Path(__file__).parents[1] / "fixtures" / "tiny" / "qwen3"


@pytest.fixture(scope="module")
def tiny_qwen3():
    from sparkinfer_cli.gguf.reader import GGUFFile
    from sparkinfer_cli.model.loader import load_model
    from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

    gguf = GGUFFile(TINY / "qwen3-F32.gguf")
    return load_model(gguf), Tokenizer.from_gguf(gguf), json.loads(
        (TINY / "qwen3.goldens.json").read_text())


@pytest.mark.slow
def test_tiny_qwen3_batched_outputs_equal_solo_outputs(tiny_qwen3):
    """18 concurrent requests (greedy and seeded sampling) produce exactly their solo outputs, with
    and without a shared prefix; the solo outputs of the golden prompts are llama.cpp's greedy."""
    model, tokenizer, goldens = tiny_qwen3
    prefix = goldens["prompt_long"][:21]  # one full block of 16 + a partial one
    prompts = [goldens["prompt_short"], goldens["prompt_long"]] + \
        [[*(prefix if i % 2 else []), *[(37 * i + 11 * j) % 480 for j in range(3 + 5 * i)]]
         for i in range(16)]
    params = [SamplingParams(max_tokens=N_TINY, temperature=0.0, ignore_eos=True, logprobs=True)] \
        * 9 + [SamplingParams(max_tokens=N_TINY, temperature=1.0, seed=i, logprobs=True)
               for i in range(9)]
    plain = ContinuousBatchEngine(model, tokenizer, EngineConfig(ctx=2048, block_size=16))
    shared = ContinuousBatchEngine(model, tokenizer, EngineConfig(ctx=2048, block_size=16,
                                                                  prefix_token_ids=tuple(prefix)))
    for engine in (plain, shared):
        engine.start()
    try:
        solo = [_run_alone(plain, prompt, p) for prompt, p in zip(prompts, params)]
        assert solo[0][0] == goldens["llama_cpp"]["F32"]["greedy_short"][:N_TINY]
        assert solo[1][0] == goldens["llama_cpp"]["F32"]["greedy_long"][:N_TINY]
        for engine in (plain, shared):
            sink = Collector()
            ids = [engine.submit(prompt, p, sink) for prompt, p in zip(prompts, params)]
            for request_id, (tokens, logprobs) in zip(ids, solo):
                sink.final(request_id)
                assert sink.tokens(request_id) == tokens
                # logprobs see KV mix-ups that leave the argmax alone
                np.testing.assert_allclose(_logprobs(sink, request_id), logprobs, atol=1e-4)
            wait_idle(engine)
        assert plain.stats().free_kv_blocks == plain.stats().total_kv_blocks
        assert shared.stats().free_kv_blocks == shared.stats().total_kv_blocks - 2
    finally:
        plain.shutdown()
        shared.shutdown()


N_TINY = 8  # tokens per request: the CPU reference model takes ~10 ms a step


@pytest.mark.parametrize("family, quant", [("qwen3", "Q8_0"), ("qwen3", "Q4_K_M"),
                                           ("qwen3moe", "Q8_0"), ("qwen35", "Q8_0"),
                                           ("qwen35moe", "Q4_K_M"), ("qwen3next", "Q8_0")])
@pytest.mark.slow
def test_quantized_outputs_do_not_depend_on_what_shares_the_pass(family, quant):
    """The runtime CPU model: 12 prompts prefilled in one pass of ~200 rows and decoded together
    give bit-identical logprobs to each prompt run alone (a pass of ≤ 20 rows; an expert sees
    a different number of rows in each). A kernel chosen by the pass size, or by the rows an
    expert gets, would change a sequence's numbers with the server's load."""
    from sparkinfer_cli.gguf.reader import GGUFFile
    from sparkinfer_cli.model.loader import load_runtime_model
    from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

    gguf = GGUFFile(TINY.parent / family / f"{family}-{quant}.gguf")
    model, tokenizer = load_runtime_model(gguf, "cpu"), Tokenizer.from_gguf(gguf)
    prompts = [[(29 * i + 13 * j) % 480 for j in range(8 + i)] for i in range(12)]
    params = SamplingParams(max_tokens=N_TINY, temperature=0.0, ignore_eos=True, logprobs=True)
    # NOTE: no prefix cache: the second round would start from the first one's KV, and a prompt
    # piece of one token attends by another kernel than a longer piece
    engine = ContinuousBatchEngine(model, tokenizer, EngineConfig(ctx=2048, block_size=16,
                                                                  prefix_cache=False))
    engine.start()
    try:
        solo = [_run_alone(engine, prompt, params) for prompt in prompts]
        sink = Collector()
        ids = [engine.submit(prompt, params, sink) for prompt in prompts]
        for request_id, (tokens, logprobs) in zip(ids, solo):
            sink.final(request_id)
            assert sink.tokens(request_id) == tokens
            assert _logprobs(sink, request_id) == logprobs
    finally:
        engine.shutdown()


def _run_alone(engine: ContinuousBatchEngine, prompt: list[int], params: SamplingParams):
    sink = Collector()
    request_id = sink.final(engine.submit(prompt, params, sink)).request_id
    return sink.tokens(request_id), _logprobs(sink, request_id)


def _logprobs(sink: Collector, request_id: str) -> list[float]:
    return [lp.logprob for e in sink.events[request_id] for lp in e.logprobs]


def test_greedy_decodes_run_as_several_passes_within_max_tokens(engines):
    """All-greedy decode steps with nothing waiting queue up to decode_steps passes
    (FakeDeviceModel.decode_greedy: each pass's ids feed the next), never past a max_tokens
    (the fake's cache raises on a position outside the block table)."""
    model = FakeDeviceModel()
    engine = engines(model, start=False, max_num_seqs=4, decode_steps=5)
    sink, prompts, budgets = Collector(), _prompts(3), (20, 11, 3)
    ids = [engine.submit(p, greedy(n), sink) for p, n in zip(prompts, budgets)]
    engine.start()
    for request_id, prompt, n in zip(ids, prompts, budgets):
        assert sink.final(request_id).finish_reason == "length"
        assert sink.tokens(request_id) == expected_greedy(prompt, n)
        assert [e.num_output_tokens for e in sink.events[request_id]] == list(range(1, n + 1))
    assert max(model.decode_steps) == 5 and 2 in model.decode_steps  # 3 tokens: 1 + 2 passes
    # no pass wasted: every prompt token and every output token but the last computed once
    assert model.num_forward_tokens == sum(len(p) + n - 1 for p, n in zip(prompts, budgets))
    wait_idle(engine)
    assert engine.stats().free_kv_blocks == engine.stats().total_kv_blocks


def test_decode_passes_run_while_waiting_requests_have_no_free_slot(engines):
    """Two sequence slots, four requests: the two running decode in runs of passes while the
    other two wait for a slot; every output is the oracle's and no pass is wasted."""
    model = FakeDeviceModel()
    engine = engines(model, start=False, max_num_seqs=2, decode_steps=4)
    sink, prompts = Collector(), _prompts(4)
    ids = [engine.submit(p, greedy(9), sink) for p in prompts]
    engine.start()
    for request_id, prompt in zip(ids, prompts):
        assert sink.final(request_id).finish_reason == "length"
        assert sink.tokens(request_id) == expected_greedy(prompt, 9)
    # both prompts of a pair prefill in one step (the batched policy), which gives each its
    # first token; the other 8 come in two runs of 4 passes: the first pair while the other two
    # wait
    assert model.decode_steps == [4, 4, 4, 4]
    assert model.num_forward_tokens == sum(len(p) + 9 - 1 for p in prompts)


def test_requests_join_between_runs_of_decode_passes(engines):
    model = FakeDeviceModel()
    engine, sink = engines(model), Collector()
    first = engine.submit([4, 5, 6], greedy(200), sink)
    while not sink.events[first]:
        time.sleep(0.001)
    second = engine.submit([7, 8], greedy(30), sink)
    assert sink.final(second).finish_reason == "length"
    assert sink.tokens(second) == expected_greedy([7, 8], 30)
    assert sink.final(first).finish_reason == "length"
    assert sink.tokens(first) == expected_greedy([4, 5, 6], 200)
    assert max(model.batch_sizes) == 2  # the two decoded together


def test_sampled_requests_decode_one_pass_a_step(engines):
    model = FakeDeviceModel()
    engine, sink = engines(model), Collector()
    request_id = engine.submit([1, 2], SamplingParams(max_tokens=12, temperature=0.7, seed=3),
                               sink)
    assert sink.final(request_id).finish_reason == "length"
    assert model.decode_steps == []


def _on_host_and_device(engines, params: list[SamplingParams]):
    """({model class: (finish reason, tokens) of each request}, the device model): the same
    requests, submitted together, on a host-sampling FakeModel and a FakeDeviceModel."""
    prompts = _prompts(len(params))
    outputs = {}
    for model in (FakeModel(), FakeDeviceModel()):
        engine, sink = engines(model, start=False, max_num_seqs=8), Collector()
        ids = [engine.submit(p, q, sink) for p, q in zip(prompts, params)]
        engine.start()
        outputs[type(model)] = [(sink.final(i).finish_reason, sink.tokens(i)) for i in ids]
        engine.shutdown()
    return outputs, model


def test_constrained_requests_pick_on_the_device_what_the_host_would(engines):
    """Requests held to a grammar (greedy and top-k sampled) on a host-sampling model and on
    one that picks on its device with the grammar's masks: identical outputs, every one in the
    grammar, and the device got a mask for every constrained row."""
    from sparkinfer_cli.engine.constraint import lark_grammar

    grammar = lark_grammar('start: /[abc]+( [abc]+)*/')
    params = [SamplingParams(max_tokens=12, ignore_eos=True, grammar=grammar, temperature=0.0),
              SamplingParams(max_tokens=12, ignore_eos=True, grammar=grammar, temperature=0.9,
                             top_k=3, seed=5),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)]  # unconstrained
    outputs, model = _on_host_and_device(engines, params)
    assert outputs[FakeModel] == outputs[FakeDeviceModel]
    for _, tokens in outputs[FakeModel][:2]:
        assert len(tokens) == 12 and set(TOKENIZER.decode(tokens)) <= set("abc ")
    masked = [rows.allowed for rows in model.sampled_rows]
    assert masked and all(m is not None and len(m) >= 2 for m in masked)
    # once every request decodes, the passes queue (decode_drawn), each with its own masks
    assert max(model.decode_steps) > 1


def test_a_grammar_left_with_no_token_in_a_queued_pass_ends_its_request(engines, monkeypatch):
    """A mask with no token allowed met between queued decode passes ends that request as
    rejected (the client's grammar, not a fault); the request beside it runs to the end."""
    from sparkinfer_cli.engine.constraint import GrammarConstraint, lark_grammar
    from sparkinfer_cli.engine.sampler import GRAMMAR_DEAD_END

    real_words, calls = GrammarConstraint.allowed_words, []

    def dead_after_three(self):
        words = real_words(self)
        calls.append(self)
        return words if words is None or calls.count(self) <= 3 else np.zeros_like(words)

    monkeypatch.setattr(GrammarConstraint, "allowed_words", dead_after_three)
    model, sink = FakeDeviceModel(), Collector()
    engine = engines(model, start=False, max_num_seqs=8)
    grammar = lark_grammar('start: /[abc]+( [abc]+)*/')
    constrained = engine.submit(_prompts(1)[0], SamplingParams(
        max_tokens=12, ignore_eos=True, grammar=grammar, temperature=0.0), sink)
    free = engine.submit([5, 6], SamplingParams(max_tokens=12, temperature=0.9, top_k=3, seed=1),
                         sink)
    engine.start()
    final = sink.final(constrained)
    assert (final.finish_reason, final.error) == ("rejected", GRAMMAR_DEAD_END)
    assert len(sink.tokens(constrained)) == 3
    assert sink.final(free).finish_reason == "length" and len(sink.tokens(free)) == 12
    assert max(model.decode_steps) > 1  # the dead end was met between queued passes


def test_sampled_requests_pick_on_the_device_what_the_host_would(engines):
    """The same seeded requests on a host-sampling model and on one that samples on its device
    (FakeDeviceModel.forward_sampled: the host's rules, u from the request's own generator):
    identical outputs. A top_k within the device's candidates samples there; top_k 0 (the whole
    vocabulary) and logprobs stay on the host."""
    def sampled(max_tokens: int = 16, **kwargs) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs)

    # the host-only requests end first, so that the later steps sample on the device
    params = [sampled(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=7),
              sampled(temperature=1.3, top_k=3, seed=8),
              sampled(temperature=0.0),
              sampled(4, temperature=0.8, seed=9),  # top_k 0: the host
              sampled(4, temperature=0.8, top_k=5, seed=10, logprobs=True)]  # the host
    outputs, model = _on_host_and_device(engines, params)
    assert outputs[FakeModel] == outputs[FakeDeviceModel]
    assert [len(tokens) for _, tokens in outputs[FakeModel]] == [q.max_tokens for q in params]
    draws = [d for rows in model.sampled_rows for d in rows]  # over both device-only phases
    assert {d.top_k for d in draws if d.temperature > 0} == {5, 3}  # the two narrow top-k ones
    assert max(model.decode_steps) > 1  # once only device-sampled requests are left, queued
    assert len({tuple(t) for _, t in outputs[FakeModel][:2]}) == 2
