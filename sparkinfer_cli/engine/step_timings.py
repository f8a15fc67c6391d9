"""StepTimings: where the engine thread's time goes, to measure the engine's own overhead.

Per kind of step ("decode": every sequence computes one token, the pass a CUDA graph replays;
"mixed": a prefill piece is in it) it adds up the steps, their wall time on the engine thread
(commands, scheduling, forward, sampling, detokenizing, events) and model.forward's share of
that. 1 − forward / step is the engine's overhead fraction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STEP_KINDS = ("decode", "mixed")


def _zeros() -> dict[str, float]:
    return dict.fromkeys(STEP_KINDS, 0.0)


def _counts() -> dict[str, int]:
    return dict.fromkeys(STEP_KINDS, 0)


@dataclass
class StepTimings:
    steps: dict[str, int] = field(default_factory=_counts)  # steps run
    step_s: dict[str, float] = field(default_factory=_zeros)  # engine-thread seconds in them
    forward_s: dict[str, float] = field(default_factory=_zeros)  # of which in model.forward

    def add(self, kind: str, step_s: float, forward_s: float) -> None:
        self.steps[kind] += 1
        self.step_s[kind] += step_s
        self.forward_s[kind] += forward_s

    def overhead_fraction(self, kind: str = "decode") -> float:
        """Share of the kind's step time spent outside model.forward (0.0 before any step)."""
        step_s = self.step_s[kind]
        return 1.0 - self.forward_s[kind] / step_s if step_s > 0 else 0.0

    def copy(self) -> StepTimings:
        return StepTimings(dict(self.steps), dict(self.step_s), dict(self.forward_s))
