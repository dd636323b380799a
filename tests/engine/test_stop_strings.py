"""Stop strings: where text ends, and what a stream may send before it knows
(src/kmesh/engine/stop_strings.py)."""

import itertools

from hypothesis import example, given
from hypothesis import strategies as st

from kmesh.engine.stop_strings import StopFilter, first_stop, held_back


def test_text_ends_before_the_earliest_stop_string():
    assert first_stop("a, b; c", [";", ","]) == 1
    assert first_stop("abc", ["x"]) is None


def test_a_stream_holds_back_what_could_begin_a_stop_string():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["xyz"]) == 0
    assert held_back("ab", ["abc", "b!"]) == 2


@given(
    text=st.text(alphabet="ab, ", max_size=30),
    stops=st.lists(st.text(alphabet="ab, ", min_size=1, max_size=3), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=6),
)
# A stop found after one that may still be starting earlier (",a" of ",aa") does not end the text.
@example(text=",aa", stops=["a", ",aa"], cuts=[2])
def test_a_stream_sends_the_text_before_the_first_stop_however_it_is_chunked(text, stops, cuts):
    stop_filter = StopFilter(stops)
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    sent = "".join(stop_filter.feed(text[a:b]) for a, b in itertools.pairwise(bounds))
    sent += stop_filter.flush()
    end = first_stop(text, stops)
    assert sent == (text if end is None else text[:end])
    assert stop_filter.stopped == (end is not None)
