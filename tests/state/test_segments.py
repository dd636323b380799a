import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kmesh.errors import ContractError
from kmesh.state.segments import Role, Segment, SegmentedPrompt, Span, trunk_end


@st.composite
def tokens_and_spans(draw):
    tokens = draw(st.lists(st.integers(0, 99), min_size=1, max_size=60))
    cuts = sorted(draw(st.sets(st.integers(0, len(tokens)), max_size=8)) | {0, len(tokens)})
    spans = []
    for start, end in itertools.pairwise(cuts):
        if draw(st.booleans()):  # leave some runs uncovered: they become private segments
            spans.append(Span(start, end, draw(st.sampled_from(list(Role)))))
    return tokens, spans


@given(tokens_and_spans())
def test_spans_cover_the_prompt_exactly(case):
    tokens, spans = case
    prompt = SegmentedPrompt.from_spans(tokens, spans)
    assert list(prompt.token_ids) == tokens
    assert all(span in prompt.spans for span in spans)
    assert prompt.spans[0].start == 0 and prompt.spans[-1].end == len(tokens)


@given(tokens_and_spans(), st.data())
def test_overlapping_spans_are_refused(case, data):
    tokens, _ = case
    if len(tokens) < 2:
        return
    start = data.draw(st.integers(0, len(tokens) - 2))
    end = data.draw(st.integers(start + 2, len(tokens)))
    with pytest.raises(ContractError, match="overlaps"):
        SegmentedPrompt.from_spans(tokens, [Span(start, end), Span(start + 1, end)])


@pytest.mark.parametrize("span", [Span(0, 0), Span(3, 2), Span(-1, 2), Span(0, 11), Span(10, 11)])
def test_empty_or_out_of_range_spans_are_refused(span):
    with pytest.raises(ContractError, match="outside the prompt"):
        SegmentedPrompt.from_spans(list(range(10)), [span])


def test_empty_segments_are_refused():
    with pytest.raises(ContractError, match="empty"):
        SegmentedPrompt.of([Segment((1, 2)), Segment(())])
    with pytest.raises(ContractError, match="at least one"):
        SegmentedPrompt.of([])


def test_a_segment_id_means_one_content():
    same = SegmentedPrompt.of([Segment((1, 2), segment_id="a"), Segment((1, 2), segment_id="a")])
    assert len(same.segments) == 2
    with pytest.raises(ContractError, match="'a' is used for two different"):
        SegmentedPrompt.of([Segment((1, 2), segment_id="a"), Segment((1, 3), segment_id="a")])


def test_the_trunk_is_the_leading_run_of_shared_spans():
    shared, private = Role.SHARED, Role.PRIVATE
    assert trunk_end([Span(0, 4, shared), Span(4, 9, shared), Span(9, 12, private)]) == 9
    assert trunk_end([Span(0, 4, shared), Span(4, 9, private), Span(9, 12, shared)]) == 4
    assert trunk_end([Span(0, 4, private), Span(4, 9, shared)]) == 0
    assert trunk_end([]) == 0
