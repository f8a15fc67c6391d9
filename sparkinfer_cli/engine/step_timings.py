"""StepTimings: where the engine thread's time goes, to measure the engine's own overhead.

Per kind of step ("decode": every sequence computes one token, the pass a CUDA graph replays;
"mixed": a prefill piece is in it) it adds up the steps, their wall time on the engine thread
(commands, scheduling, forward, sampling, detokenizing, events) and model.forward's share of
that. 1 − forward / step is the engine's overhead fraction.

StepTrace writes every step as one JSON line (SPARKINFER_STEP_TRACE): what a loaded server's
steps carried and cost, in order, which sums cannot show (a slow step among fast ones, a
prompt split into many small pieces).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

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


class StepTrace:
    """Appends one JSON line per step to a file: t (s since the trace opened), kind, decodes
    (sequences computing one token), prefills (prompt pieces), prefill_tokens, passes (decode
    passes queued at once), step_ms and forward_ms (engine-thread and model.forward time) and
    cpu_ms (the engine thread's CPU time: well below step_ms − forward_ms, it waited outside the
    model, for the GIL say). A prompt piece of one token counts as a decode."""

    def __init__(self, path: str | Path):
        self._file: TextIO = open(path, "a", buffering=1, encoding="utf-8")  # line-buffered
        self._opened = time.perf_counter()

    def write(self, piece_lengths: list[int], passes: int, step_s: float, forward_s: float,
              cpu_s: float) -> None:
        prefills = [n for n in piece_lengths if n > 1]
        record = {"t": round(time.perf_counter() - self._opened, 4),
                  "kind": "mixed" if prefills else "decode",
                  "decodes": len(piece_lengths) - len(prefills), "prefills": len(prefills),
                  "prefill_tokens": sum(prefills), "passes": passes,
                  "step_ms": round(step_s * 1e3, 3), "forward_ms": round(forward_s * 1e3, 3),
                  "cpu_ms": round(cpu_s * 1e3, 3)}
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()
