"""DraftBudget: how many drafts a step carries, from what its rows cost and how often each
request's drafts are kept; and that the engine's answers do not depend on it."""

from __future__ import annotations

import pytest
from engine_harness import Collector, greedy
from test_prefix_cache import RepeatingModel, _greedy_of

from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.engine.draft_budget import (
    COST_EWMA,
    COST_EWMA_DOWN,
    FIT_WEIGHT_CAP,
    PRIOR_TRIALS,
    SPIKE_CAP,
    STALE_PASSES,
    Acceptance,
    DraftBudget,
    PassCost,
    allocate_drafts,
)
from sparkinfer_cli.engine.kv_cache import KVCacheManager
from sparkinfer_cli.engine.policy import create_policy
from sparkinfer_cli.engine.request import Request
from sparkinfer_cli.engine.sampling_params import SamplingParams
from sparkinfer_cli.engine.scheduler import Scheduler
from sparkinfer_cli.engine.speculative import DraftLength


def cpu_cost(rows: int) -> float:
    """A CPU pass of R rows: about (R + 2) / 3 one-row passes."""
    return (rows + 2) / 3


def gpu_cost(rows: int) -> float:
    """A memory-bound decode: a few more rows cost little."""
    return 1 + rows / 64


def test_one_request_whose_drafts_are_kept_drafts_all_it_may():
    assert allocate_drafts([4], [0.9], 1, cpu_cost, 99) == [4]
    assert allocate_drafts([4], [0.6], 1, gpu_cost, 99) == [4]
    assert allocate_drafts([3], [0.9], 1, cpu_cost, 99) == [3]  # never past its cap


def test_eight_sequences_on_cpu_costs_with_middling_acceptance_draft_nothing():
    """At 60 % kept a first draft pays alone (1.6 tokens for 4/3 of a pass), not beside seven
    other sequences (their step gives 2.4 tokens a pass-unit, a draft row 1.8)."""
    assert allocate_drafts([4], [0.6], 1, cpu_cost, 99) == [1]
    assert allocate_drafts([4] * 8, [0.6] * 8, 8, cpu_cost, 99) == [0] * 8
    # on a GPU's costs they draft, up to the fourth draft (0.13 tokens) that is not worth a row
    assert allocate_drafts([4] * 8, [0.6] * 8, 8, gpu_cost, 99) == [3] * 8


def test_drafts_go_to_the_requests_whose_drafts_are_kept_first():
    rates = [0.2, 0.95, 0.5, 0.9]
    assert allocate_drafts([4] * 4, rates, 4, cpu_cost, 99) == [0, 4, 0, 2]
    assert allocate_drafts([4] * 4, rates, 4, gpu_cost, 99) == [1, 4, 2, 4]
    assert allocate_drafts([4] * 4, rates, 4, gpu_cost, 5) == [0, 4, 0, 1]  # the room


def test_the_best_count_is_found_past_a_costlier_one():
    """A measured cost need not be convex: a bump at 2 rows does not hide the cheap 5."""
    def bumpy(rows: int) -> float:
        return 3.0 if rows == 2 else 1.0 + rows / 100

    assert allocate_drafts([4], [0.5], 1, bumpy, 99) == [4]


def test_acceptance_counts_the_drafts_each_check_decided():
    acceptance = Acceptance()
    acceptance.checked(4, 2)  # two kept, the third refused, the fourth never judged
    acceptance.checked(3, 3)
    assert (acceptance.kept, acceptance.trials) == (5, 6)
    assert acceptance.rate(0.5) == (5 + PRIOR_TRIALS * 0.5) / (6 + PRIOR_TRIALS)
    assert Acceptance().rate(0.3) == 0.3  # no check yet: the prior
    acceptance.fade(0.0)
    assert acceptance.rate(0.3) == 0.3


def test_a_request_that_stopped_drafting_returns_to_the_engine_s_rate():
    """Checks that kept nothing fade as decode steps pass, so the request is tried again."""
    drafting = DraftLength(4)
    for _ in range(3):
        drafting.limit(0)
        drafting.checked(4, 0)
    low = drafting.acceptance.rate(0.8)
    for _ in range(40):
        drafting.limit(0)
    assert low < 0.4 < 0.75 < drafting.acceptance.rate(0.8)


def test_pass_cost_fits_a_line_through_the_measured_row_counts():
    cost = PassCost()
    assert cost.seconds(1) == cost.seconds(40)  # nothing measured: rows presumed free
    cost.observe(8, cpu_cost(8))
    assert cost.seconds(9) == cost.seconds(40) == pytest.approx(cpu_cost(8))
    for rows in (8, 40, 12, 8):
        cost.observe(rows, cpu_cost(rows))
    assert [cost.seconds(r) for r in (1, 20, 60)] == \
        pytest.approx([cpu_cost(r) for r in (1, 20, 60)])
    cost.observe(9, 10.0)  # a measured count is its own mean, whatever the line says
    assert cost.seconds(9) == 10.0 and cost.seconds(10) < cost.seconds(9)
    falling = PassCost()  # noise that makes more rows cheaper counts as no slope
    falling.observe(8, 1.0)
    falling.observe(12, 0.9)
    assert falling.seconds(4) == falling.seconds(40) == pytest.approx(0.95)


def test_a_stall_moves_a_row_count_s_mean_a_little_and_a_faster_pass_more():
    cost = PassCost()
    cost.observe(1, 1.0)
    cost.observe(1, 100.0)  # counts as 2.0
    assert cost.seconds(1) == pytest.approx(1.0 + COST_EWMA * (SPIKE_CAP - 1.0))
    cost.observe(1, 0.5)
    assert cost.seconds(1) == pytest.approx(1.25 + COST_EWMA_DOWN * (0.5 - 1.25))


def test_a_row_count_measured_long_ago_no_longer_counts():
    """A count measured FIT_WEIGHT_CAP times lasts STALE_PASSES passes, one measured once an
    eighth of that (a stalled measurement, say)."""
    cost, passes = PassCost(), [0]

    def measure(rows: int, seconds: float, until: int = 0) -> None:
        for _ in range((until or passes[0] + 1) - passes[0]):
            cost.observe(rows, seconds)
            passes[0] += 1

    measure(40, cpu_cost(40), until=FIT_WEIGHT_CAP)
    measure(41, 100.0)
    once = STALE_PASSES // FIT_WEIGHT_CAP
    measure(8, cpu_cost(8), until=FIT_WEIGHT_CAP + 1 + once)
    assert cost.num_known == 3 and cost.seconds(41) == 100.0
    measure(8, cpu_cost(8))
    assert cost.num_known == 2 and cost.seconds(41) < cost.seconds(40) + 1
    measure(8, cpu_cost(8), until=FIT_WEIGHT_CAP + STALE_PASSES)
    assert cost.num_known == 2 and cost.seconds(40) > cost.seconds(8)
    measure(8, cpu_cost(8))
    assert cost.num_known == 1 and cost.seconds(40) == cost.seconds(8)


def _wants(n: int, cap: int) -> list[tuple[Request, int]]:
    wants = []
    for i in range(n):
        request = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=64))
        request.drafting = DraftLength(cap)
        wants.append((request, cap))
    return wants


def test_the_budget_tries_drafting_before_it_has_measured_it():
    """Nothing measured, or only steps without drafts: every request drafts what it may. Once
    only drafting steps are measured, a step measures the rows without them; with both
    measured, eight sequences at CPU costs and the prior acceptance draft nothing."""
    budget, wants = DraftBudget(), _wants(8, 4)
    assert budget.split(wants, 8, 99) == [4] * 8
    budget.cost.observe(8, cpu_cost(8))
    assert budget.split(wants, 8, 99) == [4] * 8
    measured = DraftBudget()
    measured.cost.observe(40, cpu_cost(40))
    assert measured.split(wants, 8, 99) == [0] * 8
    measured.cost.observe(8, cpu_cost(8))
    assert measured.split(wants, 8, 99) == [0] * 8
    assert measured.split(wants[:1], 1, 99) == [1]


def test_a_step_with_a_prompt_piece_weighs_drafts_against_its_decodes_alone():
    """Beside a prompt piece of 256 tokens a draft row looks cheap against the step's cost,
    but costs more than a token by decoding: eight decodes at CPU costs draft nothing (as
    without the prompt) and the budget is told of the eight decodes, not of the step's rows."""
    config = EngineConfig()
    budget = DraftBudget()
    scheduler = Scheduler(config, KVCacheManager.from_config(config, False),
                          create_policy(config), budget=budget)
    for rows in (8, 40):
        budget.cost.observe(rows, cpu_cost(rows))
    asked = []
    split = budget.split
    budget.split = lambda wants, num_decodes, room: asked.append(num_decodes) or \
        split(wants, num_decodes, room)
    decodes = []
    for request, _ in _wants(8, 4):
        request.token_ids += [1, 2, 3, 1, 2]  # an answer whose n-gram drafts exist
        request.num_computed_tokens = request.num_tokens - 1
        decodes.append((request, 1))
    prompt = Request("p", list(range(300)), SamplingParams(max_tokens=4))
    assert scheduler._drafts(decodes + [(prompt, 256)], 99) == [[]] * 9
    assert asked == [8]
    assert [len(d) for d in scheduler._drafts(decodes[:1], 99)] == [1]  # alone it drafts


class SteepRepeatingModel(RepeatingModel):
    """RepeatingModel (its drafts are kept) whose pass cost grows with the square of its rows:
    a few drafts pay alone, none beside seven other sequences."""

    @staticmethod
    def pass_seconds(num_rows: int) -> float:
        return 1e-3 * (1 + (num_rows / 4) ** 2)


def _run_batch(engines, model, prompts, max_tokens, **config):
    engine, sink = engines(model, start=False, spec_tokens=4, **config), Collector()
    ids = [engine.submit(prompt, greedy(max_tokens), sink) for prompt in prompts]
    engine.start()  # NOTE: all queued first, so they decode together from the first step
    return engine, [sink.tokens(sink.final(request_id).request_id) for request_id in ids]


def _prompts(n: int) -> list[list[int]]:
    pattern = [3, 14, 15, 9, 26, 5, 35]
    return [(pattern[i % 7:] + pattern[:i % 7]) * 3 for i in range(n)]


def test_a_steep_pass_cost_gets_fewer_drafts_at_a_larger_batch(engines):
    """Alone, the request drafts nearly every step; eight together draft in the first decode
    step (nothing measured yet) and then, once a step without drafts is measured, no more."""
    drafted = {}
    for batch in (1, 8):
        prompts = _prompts(batch)
        engine, answers = _run_batch(engines, SteepRepeatingModel(), prompts, 30,
                                     draft_budget=True)
        assert answers == [_greedy_of(RepeatingModel, p, 30) for p in prompts]
        drafted[batch] = engine.speculation.num_draft_tokens / (30 * batch)
    assert drafted[1] > 0.5 and drafted[8] < 0.25 * drafted[1], drafted


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("budget", [True, False])
def test_greedy_answers_do_not_depend_on_the_budget(engines, hybrid, budget):
    """Prompts whose drafts are kept beside prompts whose drafts miss (the budget then drafts
    for some requests and not others in one step), on CPU-like costs."""
    class CpuCostModel(RepeatingModel):
        @staticmethod
        def pass_seconds(num_rows: int) -> float:
            return 1e-3 * cpu_cost(num_rows)

    prompts = _prompts(3) + [[(7 * i * i + j) % 50 for i in range(20)] for j in range(3)]
    engine, answers = _run_batch(engines, CpuCostModel(hybrid), prompts, 24,
                                 draft_budget=budget)
    assert answers == [_greedy_of(RepeatingModel, p, 24) for p in prompts]
    assert (engine.budget is not None) == budget and engine.speculation.num_drafts > 0
