"""StopStringMatcher: however the text is split into deltas, the emitted text is the text cut
where the first stop string to be completed starts (or all of it)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tensorrt_llm.serve.generation import StopStringMatcher

ALPHABET = "abc é"


def split(text: str, cuts: list[int]) -> list[str]:
    """``text`` cut at ``cuts``; a repeated cut is an empty delta (a token with no text: a padded
    vocabulary's extra id, a character's first bytes)."""
    points = sorted(min(c, len(text)) for c in cuts)
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def expected(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """Read character by character, generation stops at the first position where a stop string
    ends; the text is cut where that stop starts (the earliest start among those ending there)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            return text[: min(starts)], True
    return text, False


@given(
    text=st.text(ALPHABET, max_size=40),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=4).map(tuple),
    cuts=st.lists(st.integers(0, 40), max_size=12),
)
def test_streamed_text_is_cut_at_the_earliest_stop(text, stops, cuts):
    matcher = StopStringMatcher(stops)
    emitted, stopped = [], False
    for delta in split(text, cuts):
        out, stopped = matcher.push(delta)
        emitted.append(out)
        if stopped:
            break
    if not stopped:
        emitted.append(matcher.flush())
    assert ("".join(emitted), stopped) == expected(text, stops)


def test_a_stop_completed_first_wins_over_one_that_starts_earlier_but_ends_later():
    """Found by hypothesis: with stops ("é", "aéa"), "aaé" has already stopped at "é"; a later
    "a" cannot make "aéa" (starting one character earlier) the cut, streamed or not."""
    assert StopStringMatcher(("é", "aéa")).push("aaé") == ("aa", True)
    assert StopStringMatcher(("é", "aéa")).push("aaéa") == ("aa", True)
    assert expected("aaéa", ("é", "aéa")) == ("aa", True)


def test_a_possible_stop_prefix_is_held_back_until_it_is_decided():
    matcher = StopStringMatcher(("</end>",))
    assert matcher.push("text </e") == ("text ", False)
    assert matcher.push("x") == ("</ex", False)
    assert matcher.push(" more </en") == (" more ", False)
    assert matcher.push("d> tail") == ("", True)
