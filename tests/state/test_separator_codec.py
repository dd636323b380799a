import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kmesh.errors import ContractError
from kmesh.state import separator_codec as codec
from kmesh.state.segments import Role


def byte_tokens(text: str) -> list[int]:
    return list(text.encode())


separators = st.sampled_from([codec.DEFAULT_SEPARATOR, "<SEP>", "|"])
parts = st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=6)


@given(parts, separators)
def test_segments_round_trip_through_the_separated_text(texts, separator):
    if any(separator in t for t in texts) or any(
        separator in a[-len(separator) :] + b for a, b in itertools.pairwise(texts)
    ):
        return  # a separator formed across a boundary is a different prompt
    prompt = codec.decode(codec.join_text(texts, separator), byte_tokens, separator)
    assert [s.text for s in prompt.segments] == texts
    assert codec.encode(prompt, separator) == codec.join_text(texts, separator)
    assert prompt.token_ids == tuple(b for t in texts for b in t.encode())


@given(st.text(max_size=40), separators)
def test_splitting_then_joining_gives_the_text_back(text, separator):
    try:
        texts = codec.split_text(text, separator)
    except ContractError:
        return
    assert codec.join_text(texts, separator) == text


def test_default_roles_are_shared_then_instruction():
    prompt = codec.decode("a # # b # # ask", byte_tokens)
    assert [s.role for s in prompt.segments] == [Role.SHARED, Role.SHARED, Role.INSTRUCTION]


@pytest.mark.parametrize("text", ["a # #  # # b", " # # a", "a # # ", ""])
def test_empty_segments_are_refused(text):
    with pytest.raises(ContractError, match="empty"):
        codec.decode(text, byte_tokens)


def test_wrong_number_of_roles_is_refused():
    with pytest.raises(ContractError, match="2 roles given for 3 segments"):
        codec.decode("a # # b # # c", byte_tokens, roles=[Role.SHARED, Role.PRIVATE])
