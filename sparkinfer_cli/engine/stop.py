"""StopStringMatcher: finds stop strings in text that arrives in arbitrary fragments.

Generation stops where the first stop string is completed: of all occurrences in the text, the one
that ends earliest wins (on a tie, the one that starts earliest), so the result does not depend on
how the text was split into fragments. Text is emitted as soon as it cannot be the start of a stop
string; only the longest suffix that is a proper prefix of some stop string is held back.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(dict.fromkeys(s for s in stops if s))  # an empty stop string never ends
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, stopped?); on a match, the text before the stop string."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buffer = self._held + text
        cut = self._first_match(buffer)
        if cut is not None:
            self._held, self.stopped = "", True
            return buffer[:cut], True
        held = self._held_back_length(buffer)
        self._held = buffer[len(buffer) - held:] if held else ""
        return buffer[:len(buffer) - held], False

    def flush(self) -> str:
        """The held-back text, at the end of generation (no stop string matched)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> int | None:
        """Start of the occurrence that ends first (then starts first), or None."""
        best: tuple[int, int] | None = None
        for stop in self.stops:
            start = buffer.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
        return None if best is None else best[1]

    def _held_back_length(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that a stop string starts with."""
        longest = max((len(s) for s in self.stops), default=1) - 1
        for length in range(min(longest, len(buffer)), 0, -1):
            suffix = buffer[len(buffer) - length:]
            if any(stop.startswith(suffix) for stop in self.stops):
                return length
        return 0
