"""Speculative decoding with a draft model (engine/draft_model.py): the tiny GGUFs share one
vocabulary, so the tiny dense qwen3 drafts for every family. Greedy answers must equal those
without drafts, alone and together, with the prefix cache sharing blocks between requests."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from engine_harness import Collector, greedy

from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.engine.draft_model import DraftModel
from sparkinfer_cli.engine.engine import ContinuousBatchEngine
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.model.loader import load_runtime_model
from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
MAX_TOKENS = 20


def _load(family: str, quant: str = "Q8_0"):
    gguf = GGUFFile(TINY / family / f"{family}-{quant}.gguf")
    return load_runtime_model(gguf, "cpu"), Tokenizer.from_gguf(gguf)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    words = [rng.randrange(3, 200) for _ in range(30)]
    return [words, words[:12] + [7, 8, 9] * 5, [rng.randrange(3, 200) for _ in range(45)],
            words[:20] + words[:20]]


def _answers(engine: ContinuousBatchEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy answer, all submitted at once."""
    sink = Collector()
    ids = [engine.submit(p, greedy(MAX_TOKENS, ignore_eos=True), sink) for p in prompts]
    return [sink.tokens(sink.final(i).request_id) for i in ids]


def _run(engine: ContinuousBatchEngine, prompts: list[list[int]]) -> list[list[list[int]]]:
    """The prompts' answers one at a time, then all together."""
    engine.start()
    try:
        return [[_answers(engine, [p])[0] for p in prompts], _answers(engine, prompts)]
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next"])
def test_greedy_answers_with_a_draft_model_equal_those_without(family):
    """Alone and together, the prefix cache on (the prompts share blocks). The qwen3 target is
    drafted for by its own Q4_K_M file; qwen3moe's answers keep some drafts and reject others;
    the hybrid MoEs reject them all, so their Gated DeltaNet state is restored each check. The
    draft model's passes are cut at 7 tokens, so a prompt's first catch-up spans several."""
    target, tokenizer = _load(family)
    draft, _ = _load("qwen3", "Q4_K_M")
    draft.max_pass_tokens = 7
    config = EngineConfig(ctx=4096, block_size=16, prefix_cache=True)
    prompts = _prompts()
    plain = _run(ContinuousBatchEngine(target, tokenizer, config), prompts)
    engine = ContinuousBatchEngine(target, tokenizer, EngineConfig(
        ctx=4096, block_size=16, prefix_cache=True, spec_tokens=4), draft_model=draft)
    assert _run(engine, prompts) == plain
    stats = engine.speculation
    assert stats.num_drafts > 0
    if family == "qwen3moe":  # the families answer alike here: all kept (qwen3, qwen35), none
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # (the hybrid MoEs)


@pytest.mark.slow
def test_a_model_drafting_for_itself_is_always_right():
    """The draft model's KV (caught up a piece at a time, rewritten after each check, in blocks
    the prefix cache shares) must be the target's own: the same file drafting for itself keeps
    every draft, alone and together."""
    target, tokenizer = _load("qwen3moe")
    draft, _ = _load("qwen3moe")
    draft.max_pass_tokens = 7
    engine = ContinuousBatchEngine(target, tokenizer, EngineConfig(  # every step drafts
        ctx=4096, block_size=16, prefix_cache=True, spec_tokens=3, draft_budget=False),
        draft_model=draft)
    _run(engine, _prompts())
    stats = engine.speculation
    assert stats.num_draft_tokens > 8 * len(_prompts())
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_draft_model_must_fit_the_target():
    target, tokenizer = _load("qwen3")
    hybrid, _ = _load("qwen35")
    config = EngineConfig(ctx=1024, block_size=16, spec_tokens=3)
    with pytest.raises(ValueError, match="attention layers only"):
        ContinuousBatchEngine(target, tokenizer, config, draft_model=hybrid)
    with pytest.raises(ValueError, match="attention layers only"):
        DraftModel(hybrid, 8, 16)


def test_the_prefix_cache_s_block_copies_reach_the_draft_model_s_cache():
    """A prefix hit's tail block is copied in the model's cache and in the draft model's, so
    the draft model's KV of the copied positions is the prefix's own."""
    from sparkinfer_cli.engine.kv_cache import CacheOps

    target, tokenizer = _load("qwen3")
    draft, _ = _load("qwen3", "Q4_K_M")
    engine = ContinuousBatchEngine(target, tokenizer, EngineConfig(
        ctx=1024, block_size=16, spec_tokens=3), draft_model=draft)
    model_cache, draft_cache = engine.runner.cache, engine.drafter.caches[0]
    for cache in (model_cache, draft_cache):
        cache.k[:, 2] = 1.5
    engine.runner.apply_cache_ops(CacheOps(block_copies=[(2, 5)]))
    assert (model_cache.k[:, 5] == 1.5).all() and (draft_cache.k[:, 5] == 1.5).all()


def test_a_failing_drafter_costs_its_drafts_not_the_step(caplog):
    """A draft model whose pass fails (e.g. out of memory) leaves the step without drafts: every
    request still gets the answer it gets without speculation."""
    from sparkinfer_cli.engine.speculative import Drafter

    class Failing(Drafter):
        def drafts(self, wants, step_room):
            if any(limit for _, limit in wants):
                raise MemoryError("the draft model's pass")
            return [[] for _ in wants]

    target, tokenizer = _load("qwen3moe")
    config = {"ctx": 2048, "block_size": 16, "prefix_cache": True}
    plain = _run(ContinuousBatchEngine(target, tokenizer, EngineConfig(**config)), _prompts())
    engine = ContinuousBatchEngine(target, tokenizer, EngineConfig(**config, spec_tokens=3))
    engine.scheduler.drafter = Failing()
    assert _run(engine, _prompts()) == plain
    assert "drafting failed" in caplog.text and engine.speculation.num_drafts == 0
