"""Automatic prefix caching through the real engine thread, with FakeModel as the oracle: its next
token is a hash of everything a sequence's block table reads back (and, for hybrid models, its
state slot must hold exactly the hash of those tokens), so a wrong block, a stale snapshot or a
block overwritten while shared changes the output or raises."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from engine_harness import Collector, greedy, wait_idle
from fake_model import N_VOCAB, FakeDeviceModel, FakeModel, expected_greedy, next_token

from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.engine.engine import ContinuousBatchEngine
from sparkinfer_cli.engine.sampling_params import SamplingParams
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.model.loader import load_runtime_model
from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

BS = 8  # block size of these engines


def _run(engine, prompt, max_tokens=4):
    sink = Collector()
    final = sink.final(engine.submit(prompt, greedy(max_tokens), sink))
    tokens = sink.tokens(final.request_id)
    assert tokens == expected_greedy(prompt, max_tokens)
    return final, tokens


def _words(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50) for _ in range(n)]


@pytest.mark.parametrize("model_class", [FakeModel, FakeDeviceModel])
@pytest.mark.parametrize("hybrid", [False, True])
def test_a_conversation_prefills_only_what_each_turn_adds(engines, hybrid, model_class):
    """Turn n+1 = turn n's prompt + its answer + new tokens: after turn 1 only the new tokens
    (plus the answer's last token, never fed back, and for non-hybrid models the partial last
    block) are computed."""
    model = model_class(hybrid=hybrid)
    engine = engines(model, ctx=2048)
    conversation, known = _words(1, 100), 0  # known: tokens whose KV an earlier turn computed
    for turn in range(5):
        before = model.num_forward_tokens
        final, answer = _run(engine, conversation, max_tokens=12)
        computed = model.num_forward_tokens - before - 11  # less the answer's decode passes
        assert final.num_cached_tokens == (known if hybrid else known // BS * BS)
        assert computed == len(conversation) - final.num_cached_tokens
        known = len(conversation) + len(answer) - 1  # the last answer token is never fed back
        conversation = [*conversation, *answer, *_words(10 + turn, 30 + turn)]


@pytest.mark.parametrize("hybrid", [False, True])
def test_prompts_that_part_mid_block_share_only_what_is_cached(engines, hybrid):
    engine = engines(FakeModel(hybrid=hybrid), prefix_snapshot_tokens=16)
    base = _words(2, 45)
    _run(engine, base)
    for shared in (13, 16, 40, 44):  # mid-block, on a block edge, past a snapshot, all but one
        prompt = [*base[:shared], *_words(100 + shared, 9)]
        final, _ = _run(engine, prompt)
        # a hybrid model resumes at a snapshot (each 16 prompt tokens, the prompt's end);
        # a non-hybrid one at its last cached full block
        expected = (shared // 16 * 16) if hybrid else (shared // BS * BS)
        assert final.num_cached_tokens == expected


@pytest.mark.parametrize("hybrid", [False, True])
def test_the_switch_turns_reuse_off(engines, hybrid):
    model = FakeModel(hybrid=hybrid)
    engine = engines(model, prefix_cache=False)
    prompt = _words(3, 40)
    _run(engine, prompt)
    before = model.num_forward_tokens
    final, _ = _run(engine, prompt)
    assert final.num_cached_tokens == 0 and model.num_forward_tokens - before == len(prompt) + 3


@pytest.mark.parametrize("policy", ["batched", "continuous", "chunked", "priority"])
@pytest.mark.parametrize("model_class", [FakeModel, FakeDeviceModel])
@pytest.mark.parametrize("hybrid", [False, True])
def test_shared_prefixes_under_pool_pressure_stay_correct(engines, hybrid, model_class, policy):
    """Many concurrent requests over a few shared prefixes in a pool far too small to cache them
    all, with aborts and a small snapshot budget: every output matches the oracle (a block freed
    or overwritten while another request reads it would not), hits happen, and at the end every
    block and slot is free or reclaimable."""
    rng = random.Random(5)
    model = model_class(hybrid=hybrid)
    engine = engines(model, start=False, ctx=40 * BS, max_num_seqs=5, prefix_snapshots=3,
                     prefix_snapshot_tokens=16, prefill_batched=False, prefill_chunk_tokens=16,
                     sched_policy=policy)
    stems = [_words(20 + i, rng.randint(10, 60)) for i in range(4)]
    sink, prompts = Collector(), {}
    for i in range(60):
        prompt = [*rng.choice(stems)[:rng.randint(1, 60)], *_words(200 + i, rng.randint(1, 12))]
        request_id = engine.submit(prompt, greedy(rng.randint(1, 40)), sink)
        prompts[request_id] = prompt
        if rng.random() < 0.15:
            engine.abort(request_id)
    initial_free = engine.stats().free_kv_blocks
    engine.start()
    for request_id, prompt in prompts.items():
        sink.final(request_id)
        tokens = sink.tokens(request_id)
        assert tokens == expected_greedy(prompt, len(tokens))
    assert sum(sink.final(r).num_cached_tokens for r in prompts) > 0
    wait_idle(engine)
    assert engine.stats().free_kv_blocks == initial_free
    assert engine.kv.slot_pool.num_free_slots == (5 if hybrid else 0)


def test_cached_blocks_are_evicted_least_recently_used_first(engines):
    engine = engines(FakeModel(), ctx=12 * BS)  # room for about two of these requests' blocks
    first, second, third = (_words(30 + i, 40) for i in range(3))
    for prompt in (first, second):
        _run(engine, prompt)
    _run(engine, first)  # first is now the more recently used
    _run(engine, third)  # needs blocks: second's go first
    full_hit = (40 - 1) // BS * BS  # the prompt's last token is always computed
    assert _run(engine, first)[0].num_cached_tokens == full_hit
    assert _run(engine, second)[0].num_cached_tokens < full_hit


def test_counters_report_queried_and_hit_tokens(engines):
    engine = engines(FakeModel())
    prompt = _words(4, 33)
    _run(engine, prompt)
    _run(engine, [*prompt, 7])
    assert (engine.kv.num_queried_tokens, engine.kv.num_hit_tokens) == (67, 32)


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_flush_keeps_what_a_running_request_uses_and_drops_the_rest(engines, hybrid):
    """The flush is asked for from the running request's first event (the engine thread), so
    it lands between that request's steps: its answer stays the oracle's; a prompt no request
    held is gone; base's full blocks, which the request shared, stay (a hybrid model also
    needs a snapshot there, which the flush dropped)."""
    engine = engines(FakeModel(hybrid=hybrid))
    base, other = _words(40, 45), _words(41, 30)
    _run(engine, other)
    _run(engine, base)
    sink, flushes = Collector(), []

    def flush_once_running(event):
        sink(event)
        if not flushes:
            flushes.append(engine.flush_prefix_cache())

    prompt = [*base, *_words(42, 5)]
    final = sink.final(engine.submit(prompt, greedy(20), flush_once_running))
    assert sink.tokens(final.request_id) == expected_greedy(prompt, 20)
    assert final.num_cached_tokens == (45 if hybrid else 40)
    assert flushes[0].result(timeout=5) > 0
    assert _run(engine, other)[0].num_cached_tokens == 0
    assert _run(engine, base)[0].num_cached_tokens == (0 if hybrid else 40)


FAMILIES = ["qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next"]
TINY = Path(__file__).parents[1] / "fixtures" / "tiny"


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_real_models_answer_the_same_with_the_cache_on_and_off(family):
    """The tiny GGUF of each family on the CPU runtime: a conversation's next turn (a full hit),
    a prompt parting from it mid-block (a partial hit), and the first turn again once other
    prompts have evicted it: greedy tokens equal those of an engine without the cache."""
    gguf = GGUFFile(TINY / family / f"{family}-Q8_0.gguf")
    model, tokenizer = load_runtime_model(gguf, "cpu"), Tokenizer.from_gguf(gguf)
    config = {"ctx": 20 * 16, "block_size": 16, "prefix_snapshot_tokens": 32}
    cached = ContinuousBatchEngine(model, tokenizer, EngineConfig(**config))
    plain = ContinuousBatchEngine(model, tokenizer, EngineConfig(**config, prefix_cache=False))
    for engine in (cached, plain):
        engine.start()
    try:
        def both(prompt: list[int]) -> tuple[list[int], int]:
            answers = [_greedy(engine, prompt) for engine in (cached, plain)]
            assert answers[0][0] == answers[1][0], f"{family}: the cache changed the answer"
            return answers[0]

        first = _words(6, 70)
        answer, hit = both(first)
        assert hit == 0
        _, hit = both([*first, *answer, *_words(7, 20)])
        known = len(first) + len(answer) - 1  # the last answer token was never fed back
        assert hit == (known if cached.kv.is_hybrid else known // 16 * 16)
        _, hit = both([*first[:45], *_words(8, 10)])  # parts in block 2: its 2 full blocks, or
        assert hit == 32  # a hybrid model's snapshot at 32 prompt tokens
        for seed in range(4):  # ~4 × 90 tokens through a 320-token pool: the first turn is gone
            both(_words(50 + seed, 90))
        assert both(first)[1] == 0
    finally:
        for engine in (cached, plain):
            engine.shutdown()


def _greedy(engine, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], int]:
    sink = Collector()
    final = sink.final(engine.submit(prompt, greedy(max_tokens, ignore_eos=True), sink))
    return sink.tokens(final.request_id), final.num_cached_tokens


def test_a_hybrid_model_snapshots_where_the_request_asks(engines):
    """snapshot_positions (the server passes where a chat's messages end) add a resume point
    mid-block, off the interval: a prompt parting from it a little later resumes there."""
    engine = engines(FakeModel(hybrid=True), prefix_snapshot_tokens=0)
    base = _words(9, 60)
    sink = Collector()
    sink.final(engine.submit(base, greedy(2, snapshot_positions=(37,)), sink))
    final, _ = _run(engine, [*base[:41], *_words(10, 5)])
    assert final.num_cached_tokens == 37


def test_prompt_logprobs_score_every_prompt_token_even_where_the_prefix_is_cached(engines):
    """prompt_logprobs (OpenAI's echo + logprobs): one entry per prompt token, the first None,
    each the logprob the model gave that token after the ones before it; computed from scratch
    although the prompt is cached, and max_tokens 0 scores without generating."""
    model = FakeModel()
    engine = engines(model, prefill_batched=False, prefill_chunk_tokens=8)
    prompt = _words(11, 30)
    _run(engine, prompt)  # now cached
    sink = Collector()
    before = model.num_forward_tokens
    final = sink.final(engine.submit(prompt, greedy(0, prompt_logprobs=2), sink))
    assert final.finish_reason == "length" and final.num_output_tokens == 0
    assert model.num_forward_tokens - before == len(prompt) and final.num_cached_tokens == 0
    (scored,) = [e.prompt_logprobs for e in sink.events[final.request_id] if e.prompt_logprobs]
    assert scored[0] is None and [lp.token_id for lp in scored[1:]] == prompt[1:]
    for i, lp in enumerate(scored[1:], 1):  # FakeModel puts logit 1 on its greedy pick, 0 else
        favoured = next_token(prompt[:i])
        top = math.log(math.e / (math.e + N_VOCAB - 1))
        assert lp.logprob == pytest.approx(top if prompt[i] == favoured else top - 1, abs=1e-5)
        assert lp.top[0] == (favoured, pytest.approx(top, abs=1e-5)) and len(lp.top) == 2
    assert _run(engine, prompt)[0].num_cached_tokens > 0  # the cache still serves the others


# ---- n-gram speculative decoding ----------------------------------------------------------------
class RepeatingModel(FakeModel):
    """Greedy continues the sequence's pattern of period 5 (its token 5 back): an answer that
    repeats its prompt, where prompt-lookup drafts are right."""

    @staticmethod
    def pick(seen):
        return seen[-5] if len(seen) >= 5 else next_token(seen)


class RepeatingDeviceModel(FakeDeviceModel):
    """RepeatingModel's picks, made on the device as CudaModel makes them (a checked decode's
    rows come back as ids), checking drafts only in passes of up to max_draft_pass_tokens tokens
    (a pass that carries drafts and more tokens raises)."""

    pick = staticmethod(RepeatingModel.pick)
    max_draft_pass_tokens = 8

    def forward(self, batch, cache):
        if batch.logit_counts and len(batch.token_ids) > self.max_draft_pass_tokens:
            raise RuntimeError(f"drafts checked in a pass of {len(batch.token_ids)} tokens")
        return super().forward(batch, cache)


def _greedy_of(model_class, prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(model_class.pick(tokens))
    return tokens[len(prompt):]


@pytest.mark.parametrize("model_class", [FakeModel, RepeatingModel, RepeatingDeviceModel])
@pytest.mark.parametrize("hybrid", [False, True])
def test_speculative_drafts_never_change_greedy_output(engines, model_class, hybrid):
    """With drafts on, greedy outputs are the model's one-token-at-a-time greedy ones (drafts
    right or wrong, requests ending mid-draft by max_tokens or a stop token, beside requests that
    sample); where the drafts are right, far fewer passes run. A hybrid model's state must hold
    exactly the tokens its KV holds at every pass (FakeModel raises otherwise): after a rejected
    draft it is restored and the kept tokens run again. A model that picks on its device and
    checks drafts in small passes only (CudaModel) gets drafts within that size."""
    model = model_class(hybrid=hybrid)
    engine = engines(model, spec_tokens=4)
    pattern = [3, 14, 15, 9, 26]
    prompts = [pattern * 4, [*pattern * 3, 7], _words(12, 30)]
    sink, ids = Collector(), []
    for i, prompt in enumerate(prompts * 2):
        # the second round stops at the token its greedy answer has 10th
        tenth = _greedy_of(model_class, prompt, 10)[-1]
        stops = (tenth,) if i > 2 else ()
        ids.append((engine.submit(prompt, greedy(17, stop_token_ids=stops), sink), prompt, stops))
    sampled = engine.submit(prompts[0], SamplingParams(max_tokens=5, temperature=1.0, seed=3),
                            sink)
    for request_id, prompt, stops in ids:
        sink.final(request_id)
        want = _greedy_of(model_class, prompt, 17)
        if stops:
            want = want[:want.index(stops[0]) + 1]
        assert sink.tokens(request_id) == want
    assert sink.final(sampled).num_output_tokens == 5
    if model_class is RepeatingModel:
        assert len(model.batch_sizes) < 17
    if model_class is RepeatingDeviceModel:
        assert engine.speculation.num_accepted_tokens > 0


@pytest.mark.parametrize("hybrid", [False, True])
def test_drafts_fit_the_pass_a_device_model_checks_them_in(engines, hybrid):
    """One request alone on a model that checks drafts in passes of up to 3 tokens: each check
    carries at most 2 drafts however many the request may draft, keeps them where they are right,
    and the answer is greedy decoding's."""
    model = RepeatingDeviceModel(hybrid)
    model.max_draft_pass_tokens = 3
    drafted: list[int] = []
    model.before_forward = lambda batch: drafted.append(len(batch.token_ids) - 1) \
        if batch.logit_counts else None
    engine, sink = engines(model, spec_tokens=6), Collector()
    prompt = [3, 14, 15, 9, 26] * 4
    request_id = engine.submit(prompt, greedy(20), sink)
    assert sink.tokens(sink.final(request_id).request_id) == \
        _greedy_of(RepeatingModel, prompt, 20)
    assert drafted and max(drafted) == 2
    assert engine.speculation.num_accepted_tokens >= len(drafted)


def test_speculation_is_off_by_default(engines):
    engine = engines(FakeModel())
    sink = Collector()
    request_id = engine.submit([3, 14, 15] * 4, greedy(6), sink)
    assert sink.tokens(sink.final(request_id).request_id) == expected_greedy([3, 14, 15] * 4, 6)
    assert not engine._can_speculate


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next"])
def test_real_models_answer_the_same_with_drafts(family):
    """The tiny GGUFs on the CPU runtime: greedy tokens with n-gram drafts equal those without
    (drafts are checked by rows that attend one by one, as decoding does; a hybrid model's
    Gated DeltaNet state is restored after a rejected draft and the kept tokens run again in the
    next step, so drafts never add a pass), and kept drafts save passes. (The tiny qwen35
    answers repeat their prompts, so its drafts are kept; qwen35moe's and qwen3next's repeat
    nothing: every check restores.)"""
    gguf = GGUFFile(TINY / family / f"{family}-Q8_0.gguf")
    model, tokenizer = load_runtime_model(gguf, "cpu"), Tokenizer.from_gguf(gguf)
    config = {"ctx": 2048, "block_size": 16, "prefix_cache": False}
    engines = [ContinuousBatchEngine(model, tokenizer, EngineConfig(**config, spec_tokens=n))
               for n in (4, 0)]
    for engine in engines:
        engine.start()
    try:
        prompts = [_words(13, 40), [5, 6, 7, 8, 9, 10] * 8, _words(14, 12) * 3]
        for prompt in prompts:
            drafted, plain = (_greedy(engine, prompt, 24)[0] for engine in engines)
            assert drafted == plain
        steps = [sum(engine.stats().step_timings.steps.values()) for engine in engines]
        kept = engines[0].speculation.num_accepted_tokens
        assert engines[0].speculation.num_drafts > 0
        assert steps[0] <= steps[1]  # a restore's replay runs inside the next step
        if family in ("qwen3", "qwen3moe", "qwen35"):
            assert kept > 0 and steps[0] < steps[1]
    finally:
        for engine in engines:
            engine.shutdown()
