"""N-gram drafting: how many tokens a request drafts as its checks go, and what the engine
counts."""

from __future__ import annotations

import math

import pytest
from engine_harness import Collector, greedy
from test_prefix_cache import RepeatingModel, _greedy_of

from sparkinfer_cli.engine.sampling_params import SamplingParams
from sparkinfer_cli.engine.speculative import (
    FIRST_PAUSE_STEPS,
    MAX_PAUSE_STEPS,
    MISSES_TO_PAUSE,
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
    assert drafting.limit() == 4
    drafting.checked(4, 1)
    assert drafting.limit() == 2  # one kept: try one more than that
    drafting.checked(2, 2)
    assert drafting.limit() == 3
    drafting.checked(3, 3)
    drafting.checked(4, 4)
    assert drafting.limit() == 4  # never past the configured most


def test_drafts_that_keep_failing_pause_and_the_pause_doubles():
    drafting = DraftLength(4)
    pauses = []
    for _ in range(4):
        for _ in range(MISSES_TO_PAUSE):
            drafting.checked(1, 0)
        limits = [drafting.limit() for _ in range(2 * MAX_PAUSE_STEPS)]
        pauses.append(limits.index(1))  # one draft token after a miss
        assert not any(limits[:pauses[-1]])
    assert pauses == [FIRST_PAUSE_STEPS * 2 ** i for i in range(4)]
    drafting.checked(1, 1)  # a kept draft: the next misses pause for the first pause again
    for _ in range(MISSES_TO_PAUSE):
        drafting.checked(1, 0)
    assert [drafting.limit() for _ in range(FIRST_PAUSE_STEPS + 1)][-2:] == [0, 1]


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
