"""GreedyBatch: a step's plain greedy rows (no logprobs, penalties or bias) sampled together.

Each token is the argmax of a vocabulary-sized row: memory-bound work in which numpy releases the
GIL, so with many rows a step splits them over a few threads. The result is the Sampler's (the
same argmax, lowest id on ties); a row whose maximum is not finite gets None, and the Sampler,
which raises the error for it, samples that row instead.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

MIN_ROWS_PER_THREAD = 4  # below this a thread hand-off costs more than the argmax it saves


def default_num_threads() -> int:
    """A quarter of the cores, at most 4: the forward pass is done, but the server thread and
    the event loop also want a core."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


class GreedyBatch:
    def __init__(self, num_threads: int):
        self.num_threads = num_threads
        self._pool = ThreadPoolExecutor(num_threads, "sparkinfer-argmax") \
            if num_threads > 1 else None

    def tokens(self, rows: Sequence[np.ndarray]) -> list[int | None]:
        """Each row's argmax; None where its maximum is not finite."""
        num_parts = min(self.num_threads, len(rows) // MIN_ROWS_PER_THREAD)
        if self._pool is None or num_parts < 2:
            return argmax_rows(rows)
        bounds = np.linspace(0, len(rows), num_parts + 1).astype(int)  # (num_parts + 1,)
        parts = self._pool.map(lambda lo, hi: argmax_rows(rows[lo:hi]), bounds[:-1], bounds[1:])
        return [token for part in parts for token in part]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def argmax_rows(rows: Sequence[np.ndarray]) -> list[int | None]:
    tokens: list[int | None] = []
    for row in rows:
        token = int(np.argmax(row))
        tokens.append(token if math.isfinite(row[token]) else None)
    return tokens
