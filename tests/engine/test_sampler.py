"""Sampler against independent float64 references: exact distributions, hand-computed penalties."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from sparkinfer_cli.engine import truncation
from sparkinfer_cli.engine.sampler import Sampler, UnsatisfiableSampling
from sparkinfer_cli.engine.sampling_params import SamplingParams
from sparkinfer_cli.engine.truncation import (
    thread_workspace,
    top_candidates,
    top_p_positions,
    top_positions,
    truncate,
)

LOGITS_12 = np.array([2.0, 1.1, 3.2, -0.5, 0.4, 2.9, -1.7, 1.6, 0.0, -3.0, 2.4, 0.9],
                     dtype=np.float32)


# ---- reference: plain Python, float64, one token at a time --------------------------------------
def reference_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """{token: probability} after top-k → top-p → min-p → temperature (llama.cpp's chain)."""
    values = [float(v) for v in logits]
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    kept = order[:top_k] if top_k > 0 else order
    if top_p < 1.0:
        probs = softmax({i: values[i] for i in kept})
        total, cut = 0.0, []
        for i in kept:
            cut.append(i)
            total += probs[i]
            if total >= top_p:
                break
        kept = cut
    if min_p > 0.0:
        probs = softmax({i: values[i] for i in kept})
        kept = [i for i in kept if probs[i] >= min_p * max(probs.values())]
    return softmax({i: values[i] / temperature for i in kept})


def softmax(scores):
    peak = max(scores.values())
    exps = {i: math.exp(s - peak) for i, s in scores.items()}
    total = sum(exps.values())
    return {i: e / total for i, e in exps.items()}


def chi_square_critical(df, z=4.75):
    """Wilson–Hilferty quantile of chi-square at upper tail ≈ 1e-6 (z = 4.75)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def draw_counts(params, logits, n_draws):
    sampler = Sampler(params, len(logits))
    return np.bincount([sampler.sample(logits, [], []).token_id for _ in range(n_draws)],
                       minlength=len(logits))


CONFIGS = [
    {"temperature": 0.6},
    {"temperature": 1.7},
    {"temperature": 1.0, "top_k": 4},
    {"temperature": 0.8, "top_p": 0.75},
    {"temperature": 1.0, "min_p": 0.2},
    {"temperature": 1.3, "top_k": 7, "top_p": 0.9, "min_p": 0.1},
]
N_DRAWS = 8000


@pytest.mark.parametrize("config", CONFIGS,
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sampled_distribution_matches_reference(config):
    expected = reference_distribution(LOGITS_12, **config)
    n_draws = N_DRAWS
    counts = draw_counts(SamplingParams(seed=1234, **config), LOGITS_12, n_draws)
    outside = [t for t in np.flatnonzero(counts) if t not in expected]
    assert not outside, f"tokens {outside} were drawn but the reference removes them"
    chi2 = sum((counts[t] - n_draws * p) ** 2 / (n_draws * p) for t, p in expected.items())
    df = max(1, len(expected) - 1)
    assert chi2 < chi_square_critical(df), f"chi-square {chi2:.1f} with {df} dof; counts {counts}"


@pytest.mark.parametrize("config", CONFIGS[1:4],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("draft", [2, 7, 9])  # the likeliest token, a middling one, a rare one
def test_a_checked_draft_leaves_the_distribution_as_it_was(config, draft):
    """Speculative sampling of a prompt-lookup draft (Sampler.check_draft): the token that comes
    out, kept draft or drawn instead, follows the reference distribution, and the draft is kept
    as often as its probability says."""
    expected = reference_distribution(LOGITS_12, **config)
    sampler = Sampler(SamplingParams(seed=77, **config), len(LOGITS_12))
    assert sampler.checks_drafts_by_sampling
    draws = [sampler.check_draft(LOGITS_12, draft) for _ in range(N_DRAWS)]
    counts = np.bincount([token for token, _ in draws], minlength=len(LOGITS_12))
    outside = [t for t in np.flatnonzero(counts) if t not in expected]
    assert not outside, f"tokens {outside} were drawn but the reference removes them"
    chi2 = sum((counts[t] - N_DRAWS * p) ** 2 / (N_DRAWS * p) for t, p in expected.items())
    df = max(1, len(expected) - 1)
    assert chi2 < chi_square_critical(df), f"chi-square {chi2:.1f} with {df} dof; counts {counts}"
    kept, p_draft = sum(keep for _, keep in draws), expected.get(draft, 0.0)
    assert all(token == draft for token, keep in draws if keep)
    assert abs(kept - N_DRAWS * p_draft) <= 5 * math.sqrt(N_DRAWS * p_draft * (1 - p_draft)) + 1


def test_only_plain_sampled_requests_check_drafts_by_sampling():
    plain = SamplingParams(temperature=0.7, top_p=0.9)
    assert Sampler(plain, 12).checks_drafts_by_sampling
    for other in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, logprobs=True),
                  SamplingParams(temperature=0.7, repetition_penalty=1.1),
                  SamplingParams(temperature=0.7, logit_bias={3: -5.0}),
                  SamplingParams(temperature=0.7, min_tokens=2)):
        assert not Sampler(other, 12, stop_token_ids=[1]).checks_drafts_by_sampling


def test_reference_cuts_are_not_on_a_boundary():
    """The top-p / min-p configs above must not sit within float error of a cut, or the test
    would depend on rounding rather than on the rule."""
    probs = softmax(dict(enumerate(LOGITS_12.astype(float))))
    running = np.cumsum(sorted(probs.values(), reverse=True))
    assert np.min(np.abs(running - 0.75)) > 1e-3 and np.min(np.abs(running - 0.9)) > 1e-3


def test_chi_square_check_detects_a_wrong_temperature():
    """The statistical check has power: draws at T=1.0 fail against the T=0.8 reference."""
    n_draws = N_DRAWS
    counts = draw_counts(SamplingParams(seed=5, temperature=1.0), LOGITS_12, n_draws)
    expected = reference_distribution(LOGITS_12, temperature=0.85)
    chi2 = sum((counts[t] - n_draws * p) ** 2 / (n_draws * p) for t, p in expected.items())
    assert chi2 > chi_square_critical(len(expected) - 1)


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])  # flat → needs the full sort; peaked → head
@pytest.mark.parametrize("top_p", [0.5, 0.95])
def test_truncate_large_vocab_matches_reference(scale, top_p):
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(6000) * scale).astype(np.float32)
    for top_k, min_p in [(0, 0.0), (3000, 0.0), (0, 0.001), (500, 0.01)]:
        ids = truncate(logits, top_k, top_p, min_p, thread_workspace(len(logits)))
        expected = reference_distribution(logits, 1.0, top_k, top_p, min_p)
        got = set(range(len(logits))) if ids is None else set(ids.tolist())
        assert got == set(expected), (top_k, min_p, len(got), len(expected))


def test_truncate_ties_keep_lower_token_ids():
    logits = np.array([1.0, 5.0, 3.0, 5.0, 3.0, 3.0, 0.0], dtype=np.float32)
    ws = thread_workspace(len(logits))
    assert truncate(logits, 3, 1.0, 0.0, ws).tolist() == [1, 2, 3]
    assert truncate(logits, 4, 1.0, 0.0, ws).tolist() == [1, 2, 3, 4]
    assert truncate(logits, 0, 1.0, 0.0, ws) is None
    flat = np.full(4, 2.0, dtype=np.float32)  # cumulative mass 0.25, 0.5, …: exactly reaches 0.5
    assert truncate(flat, 0, 0.5, 0.0, thread_workspace(4)).tolist() == [0, 1]


def test_greedy_takes_argmax_and_lowest_id_on_ties():
    logits = np.array([0.5, 2.0, -1.0, 2.0, 1.9], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=0.0, top_k=2, top_p=0.1), len(logits))
    assert [sampler.sample(logits, [], []).token_id for _ in range(5)] == [1] * 5


def test_greedy_tie_between_a_biased_and_a_raw_logit_goes_to_the_lower_id():
    logits = np.array([1.0, 5.0, 2.0, 4.0], dtype=np.float32)
    for bias, expected in [({0: 4.0}, 0), ({3: 1.0}, 1), ({2: 3.0}, 1), ({1: -0.5, 3: 0.5}, 1)]:
        sampler = Sampler(SamplingParams(temperature=0.0, logit_bias=bias), len(logits))
        assert sampler.sample(logits, [], []).token_id == expected, bias


# ---- penalties and bias: hand-computed --------------------------------------------------------
def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 1.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(repetition_penalty=2.0), len(logits))
    # token 0 appears twice (penalised once), 1 in the prompt, 4 in the output; 3 and 5 unseen
    out = sampler.process_logits(logits, prompt_ids=[0, 1, 0], output_ids=[4, 2])
    np.testing.assert_array_equal(out, [1.0, -2.0, 0.25, 3.0, -4.0, 1.0])
    np.testing.assert_array_equal(logits, [2.0, -1.0, 0.5, 3.0, -2.0, 1.0])  # input untouched


def test_repetition_penalty_window_is_last_64_tokens_of_prompt_and_output():
    logits = np.full(8, 4.0, dtype=np.float32)
    sampler = Sampler(SamplingParams(repetition_penalty=4.0), len(logits))
    prompt = [1] + [2] * 70 + [3]  # token 1 falls out of the window, 3 stays
    out = sampler.process_logits(logits, prompt, [5] * 10)
    np.testing.assert_array_equal(out, [4, 4, 1, 1, 4, 1, 4, 4])
    out = sampler.process_logits(logits, prompt, [6] * 64)  # only the output is in the window
    np.testing.assert_array_equal(out, [4, 4, 4, 4, 4, 4, 1, 4])


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = np.zeros(5, dtype=np.float32)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = Sampler(params, 5).process_logits(logits, prompt_ids=[0, 0, 4], output_ids=[1, 2, 2, 2])
    # token 1: 1×0.25 + 0.5; token 2: 3×0.25 + 0.5; prompt tokens 0 and 4 untouched
    np.testing.assert_allclose(out, [0.0, -0.75, -1.25, 0.0, 0.0])


def test_penalties_then_bias_combine_in_order():
    logits = np.array([3.0, -1.0, 0.0], dtype=np.float32)
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5,
                            logit_bias={0: 2.0, 2: -0.5})
    out = Sampler(params, 3).process_logits(logits, [1], [0, 0])
    np.testing.assert_allclose(out, [3.0 / 1.5 - 2 * 0.5 - 1.0 + 2.0, -1.5, -0.5], rtol=1e-6)


def test_logit_bias_minus_100_bans_even_the_argmax():
    logits = np.array([0.0, 0.1, 50.0, 0.2], dtype=np.float32)
    greedy = Sampler(SamplingParams(temperature=0.0, logit_bias={2: -100}), 4)
    assert greedy.sample(logits, [], []).token_id == 3
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3, logit_bias={2: -100}), 4)
    drawn = {sampler.sample(logits, [], []).token_id for _ in range(500)}
    assert drawn == {0, 1, 3}


def test_logit_bias_outside_vocabulary_is_a_clear_error():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler(SamplingParams(logit_bias={10: 1.0}), 10)


def test_everything_banned_is_a_clear_error():
    sampler = Sampler(SamplingParams(logit_bias={0: -100, 1: -100}), 2)
    with pytest.raises(UnsatisfiableSampling, match="banned"):
        sampler.sample(np.zeros(2, dtype=np.float32), [], [])


def test_min_tokens_bans_the_stop_tokens_until_then():
    """Stop tokens 2 (the argmax, with a user bias too) and 3 are banned from two tokens."""
    logits = np.array([0.0, 0.5, 50.0, 40.0], dtype=np.float32)
    for params in (SamplingParams(temperature=0.0, min_tokens=2, logit_bias={2: 5.0}),
                   SamplingParams(temperature=0.5, min_tokens=2, seed=1)):
        sampler, out = Sampler(params, 4, stop_token_ids=(2, 3, 99)), []
        for _ in range(3):
            out.append(sampler.sample(logits, [0], out).token_id)
        assert set(out[:2]) <= {0, 1} and out[2] == 2


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, min_tokens=2),
                                    SamplingParams(temperature=0.7, top_k=4, min_tokens=2)])
def test_min_tokens_keeps_the_sampler_off_the_fast_paths_while_it_bans(params):
    """Neither plain greedy (GreedyBatch, forward_greedy) nor device sampling applies the ban."""
    logits = np.zeros(4, dtype=np.float32)
    sampler, out = Sampler(params, 4, stop_token_ids=(2,)), []
    for _ in range(2):
        assert not sampler.can_sample_on_device(64) and not sampler.is_plain_greedy
        out.append(sampler.sample(logits, [0], out).token_id)
    assert sampler.can_sample_on_device(64)
    assert sampler.is_plain_greedy == params.is_greedy


def test_min_tokens_without_stop_tokens_stays_plain_greedy():
    sampler = Sampler(SamplingParams(temperature=0.0, min_tokens=5), 4)
    assert sampler.is_plain_greedy and not sampler.may_touch_logits


def test_wrong_logits_shape_is_rejected():
    with pytest.raises(ValueError, match="shape"):
        Sampler(SamplingParams(), 4).sample(np.zeros(5, dtype=np.float32), [], [])


# ---- seed --------------------------------------------------------------------------------------
def sequence(params, n_vocab=200, steps=60):
    rng = np.random.default_rng(99)  # the "model": fixed logits per step, independent of the seed
    sampler, out = Sampler(params, n_vocab), []
    for _ in range(steps):
        logits = rng.standard_normal(n_vocab).astype(np.float32)
        out.append(sampler.sample(logits, [1, 2], out).token_id)
    return out


def test_same_seed_same_sequence_other_seed_other_sequence():
    def params(seed):
        return SamplingParams(seed=seed, temperature=1.2, top_p=0.95, repetition_penalty=1.1)
    assert sequence(params(42)) == sequence(params(42))
    assert sequence(params(42)) != sequence(params(43))


def test_no_seed_is_random():
    assert sequence(SamplingParams(temperature=1.0)) != sequence(SamplingParams(temperature=1.0))


# ---- logprobs ----------------------------------------------------------------------------------
def test_logprobs_are_log_softmax_of_processed_logits_before_temperature():
    logits = np.array([1.0, 3.0, 2.0, 3.0, -1.0, 0.5], dtype=np.float32)
    params = SamplingParams(temperature=0.3, top_k=2, logit_bias={4: 5.0}, seed=0,
                            logprobs=True, top_logprobs=3)
    result = Sampler(params, len(logits)).sample(logits, [], [])
    processed = logits.astype(np.float64) + np.array([0, 0, 0, 0, 5.0, 0])
    reference = processed - np.log(np.exp(processed).sum())
    assert result.logprob.token_id == result.token_id
    assert result.logprob.logprob == pytest.approx(reference[result.token_id], abs=1e-6)
    assert [t for t, _ in result.logprob.top] == [4, 1, 3]  # 4 after bias, then the tie by id
    np.testing.assert_allclose([lp for _, lp in result.logprob.top], reference[[4, 1, 3]],
                               atol=1e-6)


def test_logprobs_off_gives_none_and_zero_top_gives_empty_list():
    logits = np.array([0.0, 1.0], dtype=np.float32)
    assert Sampler(SamplingParams(), 2).sample(logits, [], []).logprob is None
    result = Sampler(SamplingParams(logprobs=True), 2).sample(logits, [], [])
    assert result.logprob.top == []


# ---- cost on a real vocabulary size -----------------------------------------------------------
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=0.7, top_p=0.9, min_p=0.02,
                                                   repetition_penalty=1.1, logprobs=True,
                                                   top_logprobs=5),
                                    SamplingParams(temperature=1.0, top_p=0.95)])
def test_sampling_allocates_no_vocabulary_sized_arrays(params):
    """Fresh 600 KB temporaries cost more (page faults) than the arithmetic on a 152k vocab."""
    n_vocab = 151936
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(n_vocab) * 2).astype(np.float32)  # (n_vocab,)
    logits[rng.choice(n_vocab, 40, replace=False)] += 14  # a model's few likely tokens
    sampler = Sampler(params, n_vocab)
    sampler.sample(logits, [5, 6], [7])  # creates this thread's workspace
    tracemalloc.start()
    sampler.sample(logits, [5, 6], [7])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 * 1024, f"peak {peak} bytes: a vocabulary-sized temporary was allocated"


# ---- the fast paths against a plain float64 numpy reference, over many random rows -----------
def reference_chain(logits, p: SamplingParams, prompt, output, u):
    """(token, logprob of it, margin) for the sampler's chain in float64 numpy, drawing with the
    uniform u. margin: the closest any decision came to its boundary (float32 rounding may flip
    a decision closer than ~1e-6), so the caller compares only decisions clear of it."""
    x = logits.astype(np.float64)  # (V,)
    if p.repetition_penalty != 1.0:
        window = np.unique(np.array((list(prompt) + list(output))[-64:], dtype=np.int64))
        x[window] = np.where(x[window] > 0, x[window] / p.repetition_penalty,
                             x[window] * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output:
        ids, counts = np.unique(np.array(output), return_counts=True)
        x[ids] -= p.frequency_penalty * counts + p.presence_penalty
    for t, b in p.logit_bias.items():
        x[t] = -np.inf if b <= -100 else x[t] + b
    logprob = x - (x.max() + np.log(np.exp(x - x.max()).sum()))  # (V,)
    ranked = np.lexsort((np.arange(len(x)), -x))  # most likely first, ties → lower id
    margins = [gap(x[ranked[0]], x[ranked[1]])]
    if p.is_greedy:
        return int(ranked[0]), logprob, margins[0]
    if 0 < p.top_k < len(x):
        margins.append(gap(x[ranked[p.top_k - 1]], x[ranked[p.top_k]]))
        ranked = ranked[:p.top_k]
    if p.top_p < 1.0:
        cdf = np.cumsum(np.exp(x[ranked] - x[ranked[0]]))
        cdf /= cdf[-1]
        keep = int(np.searchsorted(cdf, p.top_p, side="left")) + 1
        margins.append(np.abs(cdf[max(keep - 2, 0):keep] - p.top_p).min())
        ranked = ranked[:keep]
    if p.min_p > 0.0:
        cut = x[ranked[0]] + math.log(p.min_p)
        margins.append(np.abs(x[ranked] - cut).min())
        ranked = ranked[x[ranked] >= cut]
    kept = np.sort(ranked)
    cdf = np.cumsum(np.exp((x[kept] - x[kept].max()) / p.temperature))
    cdf /= cdf[-1]
    margins.append(np.abs(cdf - u).min())
    return int(kept[np.searchsorted(cdf, u, side="right")]), logprob, min(margins)


def gap(a: float, b: float) -> float:
    """How far two ranked logits are from swapping order (exact ties keep their id order)."""
    return math.inf if a == b else abs(a - b) / max(1.0, abs(a))


def random_case(rng: np.random.Generator):
    n_vocab = int(rng.choice([2, 12, 300, 2000, 20000]))
    logits = rng.standard_normal(n_vocab) * rng.choice([0.3, 2.0, 6.0])  # (V,)
    if rng.random() < 0.6:  # a model's few likely tokens
        logits[rng.choice(n_vocab, min(n_vocab, 8), replace=False)] += rng.choice([4.0, 12.0])
    if rng.random() < 0.2:
        logits = np.round(logits)  # many exact ties
    bias = {int(t): float(rng.choice([-100.0, -3.0, 2.5])) for t in rng.choice(n_vocab, 2)}
    bias[int(np.argmax(logits))] = float(rng.choice([-100.0, -1.0, 0.0]))
    if all(bias.get(t, 0.0) <= -100 for t in range(n_vocab)):
        bias.clear()  # an all-banned vocabulary is an error, tested above
    params = SamplingParams(
        temperature=float(rng.choice([0.0, 0.0, 0.4, 1.0, 1.5])),
        top_k=int(rng.choice([0, 0, 1, 7, 500])), top_p=float(rng.choice([1.0, 0.3, 0.8, 0.97])),
        min_p=float(rng.choice([0.0, 0.0, 0.02, 0.3])),
        repetition_penalty=float(rng.choice([1.0, 1.0, 1.3])),
        presence_penalty=float(rng.choice([0.0, 0.6])),
        frequency_penalty=float(rng.choice([0.0, -0.4])),
        logit_bias=bias if rng.random() < 0.4 else {}, seed=int(rng.integers(1 << 31)),
        logprobs=bool(rng.random() < 0.3), top_logprobs=int(rng.choice([0, 5])))
    return logits.astype(np.float32), params


def test_fast_paths_match_the_float64_reference_over_random_rows_and_params():
    rng = np.random.default_rng(2026)
    compared = ambiguous = 0
    for _ in range(400):
        logits, params = random_case(rng)
        sampler, uniforms = Sampler(params, len(logits)), np.random.default_rng(params.seed)
        for _ in range(3):
            prompt = rng.integers(0, len(logits), 10).tolist()
            output = [int(np.argmax(logits))] + rng.integers(0, len(logits), 4).tolist()
            u = 0.0 if params.is_greedy else uniforms.random()  # the sampler's own draw
            token, logprob, margin = reference_chain(logits, params, prompt, output, u)
            result = sampler.sample(logits, prompt, output)
            if margin < 1e-5:
                ambiguous += 1
                continue
            compared += 1
            assert result.token_id == token, (params, margin)
            if params.logprobs:
                assert result.logprob.logprob == pytest.approx(logprob[token], abs=1e-4)
                assert [lp for _, lp in result.logprob.top] == pytest.approx(
                    np.sort(logprob)[::-1][:params.top_logprobs], abs=1e-4)
    assert compared >= 0.97 * (compared + ambiguous)


@pytest.mark.parametrize("n_vocab", [248320, 9000])
def test_top_candidates_keep_exactly_the_values_above_their_threshold(n_vocab):
    rng = np.random.default_rng(3)
    values = rng.standard_normal(n_vocab).astype(np.float32)  # (V,)
    values[::n_vocab // truncation.SAMPLE_SIZE] += 20  # sample sees only peaks: a bad first guess
    ws = thread_workspace(n_vocab)
    for count in [1, 40, 256, 5000, n_vocab - 1, n_vocab]:
        candidates, threshold = top_candidates(values, count, ws)
        assert candidates.tolist() == np.flatnonzero(values >= threshold).tolist()
        assert len(candidates) >= count
        expected = np.lexsort((np.arange(n_vocab), -values))[:min(count, n_vocab)]
        assert top_positions(values, count, ws).tolist() == np.sort(expected).tolist()


def reference_top_p(values: np.ndarray, top_p: float) -> list[int]:
    ranked = np.lexsort((np.arange(len(values)), -values.astype(np.float64)))
    cdf = np.cumsum(np.exp(values[ranked].astype(np.float64) - values.max()))
    return sorted(ranked[:int(np.searchsorted(cdf / cdf[-1], top_p)) + 1].tolist())


@pytest.mark.parametrize("peak, top_p, needs_normaliser", [
    (30.0, 0.9, False),  # the tail bound settles the cut: no exp over the vocabulary
    (9.0, 0.9, True),  # 248k tail tokens hold real mass: the exact normaliser is needed
    (0.0, 0.5, True),  # flat: the cut lies beyond every candidate head
])
def test_top_p_uses_the_tail_bound_only_when_it_settles_the_cut(monkeypatch, peak, top_p,
                                                                 needs_normaliser):
    rng = np.random.default_rng(11)
    values = rng.standard_normal(248320).astype(np.float32)  # (V,)
    values[rng.choice(len(values), 30, replace=False)] += peak + rng.random(30).astype(np.float32)
    calls = []
    exp_sum = truncation.exp_sum
    monkeypatch.setattr(truncation, "exp_sum", lambda *a: calls.append(1) or exp_sum(*a))
    kept = top_p_positions(values, top_p, thread_workspace(len(values)))
    assert kept.tolist() == reference_top_p(values, top_p)
    assert bool(calls) == needs_normaliser
