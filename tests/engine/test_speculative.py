"""N-gram drafting: how many tokens a request drafts as its checks go, and what the engine
counts."""

from __future__ import annotations

import math

import pytest
from engine_harness import Collector, greedy
from fake_model import N_VOCAB, FakeDeviceModel, FakeModel, expected_greedy
from test_prefix_cache import RepeatingModel, _greedy_of

from sparkinfer_cli.engine.sampling_params import SamplingParams
from sparkinfer_cli.engine.speculative import (
    FIRST_PAUSE_TOKENS,
    MISSES_TO_PAUSE,
    Drafter,
    DraftLength,
    SpeculationStats,
    TokenArray,
    ngram_draft,
)


def test_a_draft_is_what_followed_the_latest_occurrence_of_the_last_tokens():
    assert ngram_draft([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3) == [7, 5, 1]
    assert ngram_draft([4, 5, 6, 4], 2) == [5, 6]  # only the last token occurs earlier
    assert ngram_draft([1, 2, 3], 4) == [] and ngram_draft([1, 1], 0) == []


def test_drafts_from_a_request_s_token_array_equal_those_from_its_list():
    """TokenArray follows a list that grows by one token or several between views (past its
    capacity, so it regrows), and starts over when given a shorter list: every view equals the
    list, and the drafts from it equal the drafts from the list."""
    import random

    rng, ids, array = random.Random(3), [], TokenArray()
    for step in range(300):
        ids.extend(rng.randrange(6) for _ in range(1 + step % 3))
        view = array.view(ids)
        assert view.tolist() == ids
        assert ngram_draft(view, 4) == ngram_draft(ids, 4)
    assert array.view(ids[:5]).tolist() == ids[:5]
    other = [9, 8, 7, 9]  # shorter than the list it followed: another list
    assert array.view(other).tolist() == other and ngram_draft(array.view(other), 2) == [8, 7]


def test_the_draft_length_follows_what_the_last_check_kept():
    drafting = DraftLength(4)
    assert drafting.limit(10) == 4
    drafting.checked(4, 1)
    assert drafting.limit(12) == 2  # one kept: try one more than that
    drafting.checked(2, 2)
    assert drafting.limit(15) == 3
    drafting.checked(3, 3)
    drafting.checked(4, 4)
    assert drafting.limit(23) == 4  # never past the configured most


def _pause_after_misses(drafting: DraftLength, position: int) -> int:
    """Tokens decoded one at a time from position until drafting resumes after a run of
    misses; each position's paused_tokens counts down to it."""
    for _ in range(MISSES_TO_PAUSE):
        drafting.checked(1, 0)
    start = position
    while not drafting.limit(position):
        assert drafting.paused_tokens(position) == drafting.paused_tokens(start) - \
            (position - start) > 0
        position += 1
    assert drafting.paused_tokens(position) == 0
    return position - start


def test_drafts_that_keep_failing_pause_and_the_pause_doubles():
    drafting = DraftLength(4)
    pauses = [_pause_after_misses(drafting, 100 * i) for i in range(1, 5)]
    assert pauses == [FIRST_PAUSE_TOKENS * 2 ** i for i in range(4)]
    drafting.checked(1, 1)  # a kept draft: the next misses pause for the first pause again
    assert _pause_after_misses(drafting, 600) == FIRST_PAUSE_TOKENS


def test_a_pause_counts_tokens_not_steps():
    """A step of queued decode passes adds several tokens at once: drafting resumes once the
    pause's tokens are decoded, however few steps that took."""
    drafting = DraftLength(3)
    for _ in range(MISSES_TO_PAUSE):
        drafting.checked(3, 0)
    assert drafting.limit(50) == 0 and drafting.paused_tokens(50) == FIRST_PAUSE_TOKENS
    assert drafting.limit(50 + FIRST_PAUSE_TOKENS) == 1  # one step later: one draft after a miss


def test_speculation_stats_count_checks_drafts_and_kept_tokens():
    stats = SpeculationStats()
    for drafted, kept in ((4, 4), (3, 0), (2, 1)):
        stats.record(drafted, kept)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 5)
    assert stats.acceptance_rate == 5 / 9 and stats.mean_accepted_length == 1 + 5 / 3
    assert SpeculationStats().mean_accepted_length == 1.0


def test_the_engine_counts_the_drafts_its_checks_keep(engines):
    """An answer that repeats its prompt (RepeatingModel): the stats show the checks and most of
    their drafts kept, the output is plain greedy decoding's, and an engine without drafts
    reports no speculation."""
    engine, sink = engines(RepeatingModel(), spec_tokens=4), Collector()
    prompt = [3, 14, 15, 9, 26] * 4
    request_id = engine.submit(prompt, greedy(24), sink)
    assert sink.tokens(sink.final(request_id).request_id) == _greedy_of(RepeatingModel, prompt, 24)
    spec = engine.stats().speculation
    assert spec is not None and spec.num_drafts >= 4
    assert spec.num_accepted_tokens >= 0.75 * spec.num_draft_tokens
    assert spec.num_drafts + spec.num_accepted_tokens <= 24  # each check gives 1 + kept tokens
    assert engines(RepeatingModel()).stats().speculation is None


@pytest.mark.parametrize("hybrid", [False, True])
def test_sampled_answers_with_drafts_keep_their_distribution(engines, hybrid):
    """RepeatingModel's logits at top_k 2 and temperature 0.5: each token is the model's pick
    with probability e²/(e² + 1) whatever came before, drafted or not. Over 200 seeded requests
    the share of picks matches that probability with drafts on as with them off, and most drafts
    are kept. A hybrid model's state matches its KV at every pass (FakeModel checks it) through
    the drafts sampling rejects."""
    p_pick = math.exp(2) / (math.exp(2) + 1)
    prompt, n_requests, max_tokens = [3, 14, 15, 9, 26] * 4, 200, 6
    shares = {}
    for spec_tokens in (0, 4):
        engine, sink = engines(RepeatingModel(hybrid), spec_tokens=spec_tokens), Collector()
        ids = [engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.5,
                                                    top_k=2, seed=seed), sink)
               for seed in range(n_requests)]
        picks = 0
        for request_id in ids:
            seen = list(prompt)
            for token in sink.tokens(sink.final(request_id).request_id):
                picks += token == RepeatingModel.pick(seen)
                seen.append(token)
        shares[spec_tokens] = picks / (n_requests * max_tokens)
        if spec_tokens:
            spec = engine.stats().speculation
            assert spec.num_drafts > n_requests and spec.acceptance_rate > 0.5
    sigma = math.sqrt(p_pick * (1 - p_pick) / (n_requests * max_tokens))
    assert all(abs(share - p_pick) < 5 * sigma for share in shares.values()), shares


class _SomeDraftsWrong(Drafter):
    """Drafts the known greedy answer with the token of every third position wrong, so that
    checks keep some drafts and reject the rest."""

    def __init__(self, answer: list[int]):
        self.answer = answer

    def drafts(self, wants, step_room: int) -> list[list[int]]:
        found = []
        for request, limit in wants:
            start = request.num_tokens
            known = self.answer[start:start + max(min(limit, step_room), 0)]
            found.append([t if p % 3 else (t + 1) % N_VOCAB for p, t in enumerate(known, start)])
            step_room -= len(found[-1])
        return found


@pytest.mark.parametrize("snapshots", [True, False])
def test_a_hybrid_model_goes_on_from_the_state_at_the_last_kept_token(engines, snapshots):
    """A check that rejects a draft leaves a hybrid model's state past it. A model that keeps the
    state after each checked row (snapshots_draft_states) goes on from the one at the last kept
    token: no token runs twice. Without those states the state goes back to its copy from
    before the pass, and the fed token, the kept drafts and the next token run again in the
    next step, which drafts too (a step without drafts there would add one token for a whole
    pass). Greedy output is unchanged and the state matches the KV at every pass (FakeModel
    checks it)."""
    model = FakeModel(hybrid=True)
    model.snapshots_draft_states = snapshots
    prompt, max_tokens = [3, 14, 15, 9, 26], 40
    answer = prompt + expected_greedy(prompt, max_tokens)
    checks = []  # (tokens before the checked rows + 1, drafts) of each piece that drafts
    model.before_forward = lambda batch: checks.extend(
        (n - (k - 1), k - 1) for n, k in zip(batch.num_new_tokens, batch.logit_counts) if k > 1)
    engine, sink = engines(model, spec_tokens=3), Collector()
    engine.scheduler.drafter = _SomeDraftsWrong(answer)
    before = model.num_forward_tokens
    request_id = engine.submit(prompt, greedy(max_tokens), sink)
    assert sink.tokens(sink.final(request_id).request_id) == answer[len(prompt):]
    spec = engine.stats().speculation
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert bool([fed for fed, _ in checks if fed > 1]) != snapshots  # pieces that run again
    # every position but the last token's is computed: once, as a fed token or a kept draft,
    # plus the rejected drafts' rows (and, without snapshots, the tokens that run again)
    once = len(answer) - 1 + spec.num_draft_tokens - spec.num_accepted_tokens
    computed = model.num_forward_tokens - before
    assert computed == once if snapshots else computed > once


class _AllDraftsWrong(_SomeDraftsWrong):
    def drafts(self, wants, step_room: int) -> list[list[int]]:
        return [[(t + 1) % N_VOCAB for t in found] for found in super().drafts(wants, step_room)]


def test_queued_decode_passes_end_with_a_pause(engines):
    """A model that queues decode passes (CudaModel) runs a paused request's pause as queued
    passes and no more: the first pause's tokens in one run, then a check again."""
    model = FakeDeviceModel()
    prompt, max_tokens = [3, 14, 15, 9, 26], 40
    engine, sink = engines(model, spec_tokens=3), Collector()
    engine.scheduler.drafter = _AllDraftsWrong(prompt + expected_greedy(prompt, max_tokens))
    queued = []
    run_decode_steps = engine.runner.run_decode_steps
    engine.runner.run_decode_steps = lambda output, n_steps, draws=None: (
        queued.append(n_steps), run_decode_steps(output, n_steps, draws))[1]
    request_id = engine.submit(prompt, greedy(max_tokens), sink)
    assert sink.tokens(sink.final(request_id).request_id) == expected_greedy(prompt, max_tokens)
    assert queued[:2] == [FIRST_PAUSE_TOKENS, 2 * FIRST_PAUSE_TOKENS]
    assert engine.stats().speculation.num_drafts >= 3 * MISSES_TO_PAUSE
