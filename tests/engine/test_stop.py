"""StopStringMatcher against a brute-force reference, over every way of fragmenting the text."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from sparkinfer_cli.engine.stop import StopStringMatcher


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """Scan end positions left to right: the first stop string completed wins."""
    for end in range(1, len(text) + 1):
        starts = [start for start in range(end) if text[start:end] in stops]
        if starts:
            return text[:min(starts)], True
    return text, False


def reference_held(text: str, stops: list[str]) -> int:
    return max((k for k in range(1, len(text) + 1)
                for s in stops if len(s) > k and s.startswith(text[-k:])), default=0)


def run(fragments: list[str], stops: list[str]) -> tuple[str, bool]:
    """Feed the fragments; after each push, check what was held back against the reference."""
    matcher, emitted, seen = StopStringMatcher(stops), "", ""
    for fragment in fragments:
        out, stopped = matcher.push(fragment)
        emitted += out
        seen += fragment
        if stopped:
            return emitted, True
        assert seen.startswith(emitted)
        assert len(seen) - len(emitted) == reference_held(seen, stops), (fragments, stops)
    return emitted + matcher.flush(), False


def cut_at(text: str, points) -> list[str]:
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def splits(text: str):
    """Every composition of a short text; every split into 1–3 fragments of a long one."""
    inner = range(1, len(text))
    if len(text) <= 12:
        for n in range(len(text)):
            yield from (cut_at(text, points) for points in itertools.combinations(inner, n))
    else:
        for n in range(3):
            yield from (cut_at(text, points) for points in itertools.combinations(inner, n))


CASES = [
    ("Hello world</s> and more", ["</s>"]),
    ("no stop string here", ["STOP", "###"]),
    ("abcabd", ["abd"]),  # a false start that overlaps the real match
    ("aaab", ["aab"]),
    ("xyzw", ["xyz", "yzw"]),  # both occur: the one completed first wins
    ("abcd", ["abcd", "bc"]),  # the shorter one inside the longer ends first
    ("abc", ["bc", "abc"]),  # same end: the earlier start wins
    ("ends with a partial <|im", ["<|im_end|>"]),
    ("über→🙂 stop", ["🙂 s", "→"]),
    ("", ["x"]),
]


def test_every_split_point_of_every_case_matches_the_reference():
    for text, stops in CASES:
        expected = reference(text, stops)
        for fragments in splits(text):
            assert run(fragments, stops) == expected, (fragments, stops)


def test_empty_fragments_change_nothing():
    assert run(["", "Hel", "", "lo</", "", "s>x", ""], ["</s>"]) == ("Hello", True)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=12),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
       cut_seed=st.lists(st.booleans(), min_size=11, max_size=11))
def test_random_texts_and_stop_sets(text, stops, cut_seed):
    points = [i for i, cut in enumerate(cut_seed[:max(0, len(text) - 1)], start=1) if cut]
    assert run(cut_at(text, points), stops) == reference(text, stops)


def test_after_a_stop_nothing_more_is_emitted():
    matcher = StopStringMatcher(["END"])
    assert matcher.push("abcEN") == ("abc", False)
    assert matcher.push("Dtail") == ("", True)
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""


def test_flush_returns_held_back_prefix_when_no_stop_completes():
    matcher = StopStringMatcher(["<|im_end|>"])
    assert matcher.push("answer <|im") == ("answer ", False)
    assert matcher.flush() == "<|im"
    assert matcher.flush() == ""


def test_no_stops_and_empty_stops_hold_nothing_back():
    for stops in ([], [""]):
        matcher = StopStringMatcher(stops)
        assert matcher.push("abc") == ("abc", False)
        assert matcher.flush() == ""
