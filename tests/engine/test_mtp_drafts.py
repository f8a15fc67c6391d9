"""Speculative decoding with the model's MTP head (engine/mtp_drafts.py, model/mtp.py), on
synthetic tiny Qwen3.5-MoE and Qwen3.5 files with one NextN block: greedy answers equal those
without drafts, and every draft is what the head gives when it is run afresh over the whole
sequence (so the hidden states the engine keeps and the head's KV are those of the right
positions)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from engine_harness import Collector, greedy

from sparkinfer_cli.engine import mtp_drafts
from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.engine.engine import ContinuousBatchEngine
from sparkinfer_cli.engine.speculative import DraftLength, HiddenRows
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.gguf.synthetic import PRESETS, write_synthetic
from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.loader import load_model, load_runtime_model
from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

BLOCK = 16


@pytest.fixture(scope="module", params=["tiny-qwen35moe-mtp", "tiny-qwen35-mtp", "head-only"])
def mtp_files(tmp_path_factory, request):
    """(model file, head-only file or None): a head with an MoE FFN, a dense one (tied
    embeddings), and an MoE head in a file of its own beside a model without one (llama.cpp's
    convert_hf_to_gguf.py --mtp and --no-mtp)."""
    folder = tmp_path_factory.mktemp("mtp")
    if request.param != "head-only":
        return write_synthetic(folder / f"{request.param}.gguf", request.param), None
    head = dataclasses.replace(PRESETS["tiny-qwen35moe-mtp"], head_only=True)
    return (write_synthetic(folder / "model.gguf", "tiny-qwen35moe"),
            write_synthetic(folder / "head.gguf", head))


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    words = [rng.randrange(3, 400) for _ in range(40)]
    return [words[:23], [5, 6, 7] * 9, words, words[:23] + [9, 9]]


def _answers(engine: ContinuousBatchEngine, prompts: list[list[int]],
             max_tokens: int = 16) -> list[list[int]]:
    sink = Collector()
    ids = [engine.submit(p, greedy(max_tokens, ignore_eos=True), sink) for p in prompts]
    return [sink.tokens(sink.final(i).request_id) for i in ids]


def _engine(model, tokenizer, draft_budget: bool = False, **kwargs) -> ContinuousBatchEngine:
    spec = {"spec_tokens": 3, "draft_budget": draft_budget} if kwargs.get("use_mtp") else {}
    return ContinuousBatchEngine(model, tokenizer, EngineConfig(
        ctx=4096, block_size=BLOCK, prefix_cache=True, **spec), **kwargs)


@pytest.mark.slow
def test_greedy_answers_with_mtp_drafts_equal_those_without(mtp_files):
    """Alone and together, the prefix cache on (two prompts share blocks)."""
    gguf = GGUFFile(mtp_files[0])
    model = load_runtime_model(gguf, "cpu", with_mtp=True, mtp_file=mtp_files[1])
    tokenizer = Tokenizer.from_gguf(gguf)
    answers = {}
    for use_mtp in (False, True):
        engine = _engine(model, tokenizer, use_mtp=use_mtp)
        engine.start()
        try:
            answers[use_mtp] = [_answers(engine, [p])[0] for p in _prompts()], \
                _answers(engine, _prompts())
        finally:
            engine.shutdown()
    assert answers[True] == answers[False]
    assert engine.speculation.num_drafts > 0


@pytest.mark.slow
def test_a_model_that_picks_tokens_on_its_device_hands_the_head_its_states(
        mtp_files, monkeypatch):
    """As a CUDA model does: greedy steps take argmax ids from the device, and queue several
    decode passes (which return no hidden states: forward_greedy and decode_greedy still
    raise); with an MTP head every step runs forward_greedy_hidden (the ids and the states)
    and the answers are those of the model without drafts."""
    model = load_model(mtp_files[0], "cpu", with_mtp=True, mtp_file=mtp_files[1])
    tokenizer = Tokenizer.from_gguf(GGUFFile(mtp_files[0]))
    passes = []

    def greedy_hidden(batch, cache):
        logits, hidden = model.forward_hidden(batch, cache)
        passes.append(len(batch.token_ids))
        return np.argmax(logits, axis=1), hidden

    answers = {}
    for use_mtp in (False, True):
        monkeypatch.setattr(model, "picks_on_device", use_mtp)
        monkeypatch.setattr(model, "max_queued_steps", 4 if use_mtp else 1)
        monkeypatch.setattr(model, "forward_greedy_hidden", greedy_hidden)
        engine = _engine(model, tokenizer, use_mtp=use_mtp)
        engine.start()
        try:
            answers[use_mtp] = _answers(engine, _prompts())
        finally:
            engine.shutdown()
    assert answers[True] == answers[False]
    assert engine.speculation.num_drafts > 0 and passes


@pytest.mark.slow
def test_every_mtp_draft_is_the_head_run_afresh_over_the_sequence(mtp_files, monkeypatch):
    """Each step's drafts, recomputed from scratch: the model's hidden states of the whole
    sequence in one pass, the head over every (hidden at p, token p + 1) pair, then drafting on
    from its own state. Fails when a kept hidden state or a head KV entry belongs to another
    position (a draft that keeps missing would only slow decoding down). Every step drafts the
    most it may (the random head's drafts miss, which would shorten them), and the head takes a
    prompt's pairs in passes of at most 7."""
    monkeypatch.setattr(DraftLength, "checked", lambda self, drafted, kept: None)
    monkeypatch.setattr(mtp_drafts, "DRAFTER_PASS_TOKENS", 7)
    model = load_model(mtp_files[0], "cpu", with_mtp=True, mtp_file=mtp_files[1])
    engine = _engine(model, Tokenizer.from_gguf(GGUFFile(mtp_files[0])), use_mtp=True)
    seen: list[tuple[list[int], list[int], list[np.ndarray]]] = []  # tokens, drafts, logits
    drafts, head = engine.drafter.drafts, model.mtp.forward
    passes: list[np.ndarray] = []  # the logits of each head pass of one step (drafting last)

    def head_pass(hidden, batch, cache):
        logits, states = head(hidden, batch, cache)
        passes.append(logits)
        return logits, states

    def logged(wants, room):
        passes.clear()
        found = drafts(wants, room)
        drafting = [(r, d) for (r, _), d in zip(wants, found) if d]
        steps = passes[len(passes) - max((len(d) for _, d in drafting), default=0):]
        for i, (request, guessed) in enumerate(drafting):  # step s holds the ones going on
            rows = [steps[s][sum(len(d) > s for _, d in drafting[:i])]
                    for s in range(len(guessed))]
            seen.append((list(request.token_ids), guessed, rows))
        return found

    monkeypatch.setattr(model.mtp, "forward", head_pass)
    monkeypatch.setattr(engine.scheduler.drafter, "drafts", logged)
    engine.start()
    try:
        _answers(engine, _prompts()[:2], max_tokens=24)
    finally:
        engine.shutdown()
    assert len(seen) >= 8
    for tokens, found, logits in seen:
        fresh, fresh_logits = _fresh_drafts(model, tokens, len(found))
        assert fresh == found
        np.testing.assert_allclose(np.stack(logits), np.stack(fresh_logits), rtol=0, atol=1e-5)


def _fresh_drafts(model, tokens: list[int], k: int) -> tuple[list[int], list[np.ndarray]]:
    n, blocks = len(tokens), np.arange(-(-(len(tokens) + k) // BLOCK), dtype=np.int32)
    cache = model.create_cache(len(blocks), BLOCK, 1)
    _, hidden = model.forward_hidden(SequenceBatch.single(np.asarray(tokens, np.int32), 0,
                                                          blocks, 0), cache)
    head_cache = model.mtp.create_cache(len(blocks), BLOCK)
    rows = np.concatenate([np.zeros_like(hidden[:1]), hidden[:n - 1]])  # pairs at 0 .. n - 1
    batch = SequenceBatch.single(np.asarray(tokens, np.int32), 0, blocks, 0)
    found, all_logits = [], []
    for step in range(k):
        logits, h = model.mtp.forward(rows, batch, head_cache)
        found.append(int(np.argmax(logits[-1])))
        all_logits.append(logits[-1])
        rows, batch = h[-1:], SequenceBatch.single(np.asarray(found[-1:], np.int32), n + step,
                                                   blocks, 0)
    return found, all_logits


def test_hidden_rows_follow_the_passes_that_computed_them():
    rows = HiddenRows()
    assert rows.take(0, 1) is None
    rows.put(0, np.arange(5.0)[:, None])
    rows.put(3, np.array([[30.0], [40.0], [50.0]]))  # a restored sequence recomputes 3 and 4
    assert rows.take(2, 6).ravel().tolist() == [2.0, 30.0, 40.0, 50.0]
    rows.drop_before(4)
    assert rows.take(3, 4) is None and rows.take(4, 6).ravel().tolist() == [40.0, 50.0]
    rows.put(9, np.array([[90.0]]))  # a gap starts afresh
    assert (rows.start, rows.end) == (9, 10)
    rows.put(10, np.array([[100.0], [110.0]]))
    rows.put(12, np.array([[120.0], [130.0]]))
    rows.put(11, np.array([[111.0]]))  # replaces 11 and what follows, across pieces
    assert rows.take(9, 12).ravel().tolist() == [90.0, 100.0, 111.0] and rows.end == 12
    rows.drop_before(11)
    assert (rows.start, rows.take(11, 12).ravel().tolist()) == (11, [111.0])


def test_mtp_needs_a_head_that_fits(fixtures_dir, tmp_path):
    plain = fixtures_dir / "tiny" / "qwen35moe" / "qwen35moe-Q8_0.gguf"
    with pytest.raises(ValueError, match="no MTP head"):
        load_model(plain, "cpu", with_mtp=True)
    dense_head = dataclasses.replace(PRESETS["tiny-qwen35-mtp"], head_only=True)
    with pytest.raises(ValueError, match="is no MTP head of"):  # 2 blocks, not 4; other FFN
        load_model(plain, "cpu", with_mtp=True,
                   mtp_file=write_synthetic(tmp_path / "head.gguf", dense_head))
    model = load_model(plain, "cpu")
    with pytest.raises(ValueError, match="no MTP head"):
        ContinuousBatchEngine(model, Tokenizer.from_gguf(GGUFFile(plain)),
                              EngineConfig(ctx=512, spec_tokens=2), use_mtp=True)
