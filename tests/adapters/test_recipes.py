"""Adapter recipes as values: deterministic, keyed by everything that shapes the weights, and
refusing kinds and counts that do not exist."""

import dataclasses
import re

import pytest

from kmesh.adapters.recipes import (
    KINDS,
    PERSONAS,
    QUESTIONS,
    QUESTIONS_PER_ADAPTER,
    recipe_digest,
    recipes,
)
from kmesh.errors import InvalidRequestError


def test_the_same_adapter_always_has_the_same_recipe_and_digest():
    for kind in KINDS:
        first, again = recipes(kind, 3), recipes(kind, 3)
        assert first == again
        assert [recipe_digest(r, "model") for r in first] == [
            recipe_digest(r, "model") for r in again
        ]


def test_the_digest_changes_with_the_kind_the_index_a_hyper_parameter_and_the_model():
    lora, activated = recipes("lora", 2), recipes("activated", 2)
    digests = {
        recipe_digest(lora[0], "model"),
        recipe_digest(lora[1], "model"),
        recipe_digest(activated[0], "model"),
        recipe_digest(dataclasses.replace(lora[0], learning_rate=2e-3), "model"),
        recipe_digest(lora[0], "another model"),
    }
    assert len(digests) == 5
    assert all(re.fullmatch(r"[0-9a-f]{16}", d) for d in digests)


def test_adapter_i_takes_persona_i_and_eight_distinct_questions_picked_by_its_seed():
    all_recipes = recipes("lora", len(PERSONAS))
    assert [r.persona for r in all_recipes] == list(PERSONAS)
    for r in all_recipes:
        assert len(set(r.questions)) == QUESTIONS_PER_ADAPTER
        assert set(r.questions) <= set(QUESTIONS)
    assert len({r.questions for r in all_recipes}) > 1


def test_there_are_sixteen_or_more_personas_with_short_lowercase_names():
    assert len(PERSONAS) >= 16
    assert len({p.name for p in PERSONAS}) == len(PERSONAS)
    assert all(re.fullmatch(r"[a-z]{2,12}", p.name) for p in PERSONAS)


def test_only_an_activated_adapter_has_an_invocation_text():
    assert recipes("lora", 1)[0].invocation_text is None
    assert recipes("activated", 1)[0].invocation_text == f"<|im_start|>{PERSONAS[0].name}\n"


def test_an_unknown_kind_is_refused_naming_the_kinds():
    with pytest.raises(
        InvalidRequestError, match=r"unknown adapter kind 'dora'.*'lora', 'activated'"
    ):
        recipes("dora", 1)


@pytest.mark.parametrize("count", [0, len(PERSONAS) + 1])
def test_a_count_outside_one_to_the_number_of_personas_is_refused(count):
    with pytest.raises(InvalidRequestError, match=f"from 1 to {len(PERSONAS)}"):
        recipes("lora", count)
