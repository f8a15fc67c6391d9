"""DraftBudget: how many drafts each decoding request carries in a step, chosen for the
decodes' expected tokens per second of forward pass.

A check of k drafts at per-draft acceptance a gives 1 + a + a² + … + a^k tokens in expectation
(a draft counts only if every draft before it was kept), and it adds k rows to the pass. What a
row costs depends on the device and the batch: on the CPU a pass of R rows costs about
(R + 2) / 3 one-row passes (each weight row's decode is shared, each input row adds work), so at
batch 8 four drafts each (40 rows) cost ~4× the 8-row step and rarely pay; a GPU decode is
memory-bound, so extra rows are nearly free at small batches and not at large ones. So the engine
measures what its passes cost (PassCost), keeps each request's acceptance (Acceptance, with the
engine's as its prior), and a step adds draft rows best expected gain first while its decodes'
expected tokens per second grow (allocate_drafts; a prompt piece in the step is paid for anyway
and does not count). Each request stays capped by what its
DraftLength allows now (speculative.py): the budget decides how many, never which tokens, so
the output is the same with it on or off.

Not counted: the drafter's own time (a draft model's passes), only the checking pass's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparkinfer_cli.engine.request import Request

# the weight of a new measurement in a row count's running mean (steps vary ±20 % on a busy host),
# more for one below the mean: a busy host makes passes slower, never faster
COST_EWMA = 0.25
COST_EWMA_DOWN = 0.5
# a measurement counts as at most this many times its row count's mean: a stall (another thread,
# a collection) must not stop drafting at that count until it is measured again and again
SPIKE_CAP = 2.0
# a row count measured over this many passes ago no longer counts: the cost drifts as contexts
# grow, and a stale figure must not stop drafting (or keep it going) forever. One measured n
# times lasts n / FIT_WEIGHT_CAP of that: a single stalled measurement goes in 32 passes
STALE_PASSES = 256
FIT_WEIGHT_CAP = 8  # a row count's weight in the line: its measurements, at most this many
# a request's own checks fade by this much each decode step, so one that stopped drafting for a
# bad stretch returns to the engine's rate and is tried again (content changes: prose → quote)
REQUEST_FADE = 0.9
ENGINE_FADE = 0.99  # the engine's rate fades by this much each check: it follows the workload
PRIOR_TRIALS = 2.0  # the prior counts as this many drafts checked
INITIAL_ACCEPTANCE = 0.5  # the engine's prior before any check (n-gram drafts keep 35–93 %)


class Acceptance:
    """The chance that a draft is kept once the drafts before it were: kept drafts over drafts
    that were decided (the kept ones and the first one not kept; those after it were never
    judged), from checks that fade as they age."""

    def __init__(self) -> None:
        self.kept = 0.0
        self.trials = 0.0

    def checked(self, drafted: int, kept: int) -> None:
        self.kept += kept
        self.trials += kept + (kept < drafted)

    def fade(self, factor: float) -> None:
        self.kept *= factor
        self.trials *= factor

    def rate(self, prior: float) -> float:
        """The estimate, shrunk toward prior as though PRIOR_TRIALS drafts had kept that share."""
        return (self.kept + PRIOR_TRIALS * prior) / (self.trials + PRIOR_TRIALS)


class PassCost:
    """Seconds of forward pass a step of R rows (tokens) takes: a running mean per row count
    the engine measured lately, and for the other counts a line a + b·R fit through those. The
    means themselves where known: a kernel that changes at some row count makes the cost jump
    there (on the CPU demo models a pass of 9 rows costs 1.3× one of 8), which a line spreads
    over every count. Until two counts are measured the line is flat: extra rows are presumed
    free, so drafting is tried (and so measured)."""

    def __init__(self) -> None:
        self._means: dict[int, float] = {}  # row count → running mean seconds
        self._counts: dict[int, int] = {}  # measurements of each row count
        self._last: dict[int, int] = {}  # row count → the pass that last measured it
        self._passes = 0
        self._line: tuple[float, float] | None = None  # (a, b), until the next measurement

    def observe(self, rows: int, seconds: float) -> None:
        self._passes += 1
        mean = self._means.get(rows)
        if mean is None:
            self._means[rows] = seconds
        else:
            weight = COST_EWMA if seconds > mean else COST_EWMA_DOWN
            self._means[rows] = mean + weight * (min(seconds, SPIKE_CAP * mean) - mean)
        self._counts[rows] = self._counts.get(rows, 0) + 1
        self._last[rows] = self._passes
        for stale in [r for r in self._last if self._is_stale(r)]:
            del self._means[stale], self._counts[stale], self._last[stale]
        self._line = None

    def _is_stale(self, rows: int) -> bool:
        lasts = STALE_PASSES * min(self._counts[rows], FIT_WEIGHT_CAP) // FIT_WEIGHT_CAP
        return self._passes - self._last[rows] > lasts

    @property
    def num_known(self) -> int:
        """Row counts measured lately."""
        return len(self._means)

    def is_known(self, rows: int) -> bool:
        return rows in self._means

    def seconds(self, rows: int) -> float:
        if rows in self._means:
            return self._means[rows]
        if self._line is None:
            self._line = self._fit()
        a, b = self._line
        return max(a + b * rows, 1e-9)  # NOTE: a line fit on far counts can go below zero

    def _fit(self) -> tuple[float, float]:
        """Weighted least squares over the known counts; a flat line with fewer than two (or a
        falling fit: rows never make a pass cheaper, that is noise)."""
        if not self._means:
            return 1.0, 0.0
        weights = {r: float(min(n, FIT_WEIGHT_CAP)) for r, n in self._counts.items()}
        total = sum(weights.values())
        mean_r = sum(w * r for r, w in weights.items()) / total
        mean_s = sum(w * self._means[r] for r, w in weights.items()) / total
        spread = sum(w * (r - mean_r) ** 2 for r, w in weights.items())
        if spread == 0:
            return mean_s, 0.0
        slope = sum(w * (r - mean_r) * (self._means[r] - mean_s)
                    for r, w in weights.items()) / spread
        if slope <= 0:
            return mean_s, 0.0
        return mean_s - slope * mean_r, slope


def allocate_drafts(caps: Sequence[int], rates: Sequence[float], num_decodes: int,
                    cost: Callable[[int], float], room: int) -> list[int]:
    """Drafts for each request (at most caps[i], room in all) beside num_decodes decodes (a row
    and a token each): the draft rows go best expected gain first (request i's j-th draft adds
    rates[i] ** j tokens), and the step keeps the number of them that gives the most expected
    tokens per second of cost(rows)."""
    candidates = sorted((-(rates[i] ** j), j, i) for i, cap in enumerate(caps)
                        for j in range(1, cap + 1))[:max(room, 0)]
    best_n, best = 0, num_decodes / cost(num_decodes)
    tokens = float(num_decodes)
    for n, (gain, _, _) in enumerate(candidates, 1):
        tokens -= gain
        # NOTE: the best count over all, not the first fall: a measured cost need not be convex
        value = tokens / cost(num_decodes + n)
        if value > best:
            best_n, best = n, value
    counts = [0] * len(caps)
    for _, _, i in candidates[:best_n]:
        counts[i] += 1
    return counts


class DraftBudget:
    """The engine's costs and acceptance, and each step's split of drafts by them."""

    def __init__(self) -> None:
        self.cost = PassCost()
        self.acceptance = Acceptance()  # every request's: the prior of each request's own

    def checked(self, drafted: int, kept: int) -> None:
        self.acceptance.fade(ENGINE_FADE)
        self.acceptance.checked(drafted, kept)

    def split(self, wants: Sequence[tuple[Request, int]], num_decodes: int,
              room: int) -> list[int]:
        """The drafts each (request, the most it may draft now) carries in a step with
        num_decodes decodes and room for that many drafted tokens in all. A step that also
        carries prompt pieces weighs its drafts against its decodes alone: the prompt's rows
        are paid for anyway, and a draft must beat what a token costs by decoding."""
        if not any(cap > 0 for _, cap in wants):
            return [0] * len(wants)
        # NOTE: one measured count fits no line. Where only drafting steps were measured, the
        # step measures the rows without drafts
        if self.cost.num_known == 1 and not self.cost.is_known(num_decodes):
            return [0] * len(wants)
        prior = self.acceptance.rate(INITIAL_ACCEPTANCE)
        rates = [0.0 if request.drafting is None else request.drafting.acceptance.rate(prior)
                 for request, _ in wants]
        return allocate_drafts([cap for _, cap in wants], rates, num_decodes, self.cost.seconds,
                               room)
