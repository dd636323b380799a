"""Scoring probes: answers from the engine's distributions or text, full prefill's margins, and
a strategy's comparison with full prefill, on small probes built by hand."""

import math

import pytest

from kmesh.bench.tasks.score import ProbeResult, accuracy, answers, compare, scored_positions
from kmesh.workloads.tasks import Item, Probe

OTHER = 999  # a token no item asks for

# A forced record: header 100, 101; member 0's number at 2, 3; separator 102; member 1's at 4, 5.
FORCED = Probe(
    "record_reading",
    1,
    0,
    (100, 101, 5, 6, 102, 7, 8),
    (Item("1/0/record_reading/0", (5, 6), (2, 3)), Item("1/0/record_reading/1", (7, 8), (5, 6))),
)
CHOICE = Probe("lookup", 1, 0, (100, 101), (Item("1/0/lookup/1", (11,), candidates=(10, 11, 12)),))
FREE = Probe(
    "record_free",
    1,
    0,
    (100, 101),
    tuple(
        Item(f"1/0/record_free/{k}", number, name=name)
        for k, (name, number) in enumerate([("Ann", "47"), ("Ben", "12"), ("Cara", "30")])
    ),
)


def _dist(probs: dict[int, float]) -> dict[int, float]:
    return {token: math.log(p) for token, p in probs.items()}


def _forced(probe: Probe, rows: dict[int, dict[int, float] | None] | None = None) -> ProbeResult:
    """Per tail index j >= 1 a distribution whose top-1 is tail[j] (0.8 against OTHER's 0.1),
    unless `rows` gives index j's (None: a row the engine did not compute)."""
    given = rows or {}
    positions: list[dict[int, float] | None] = [None]
    for j, token in enumerate(probe.tail[1:], start=1):
        positions.append(given.get(j, _dist({token: 0.8, OTHER: 0.1})))
    return ProbeResult(positions=tuple(positions))


# answers


def test_forced_answers_are_the_top_tokens_at_the_items_positions():
    right, other = answers(FORCED, _forced(FORCED))
    assert right.answer == (5, 6) and right.correct
    assert other.answer == (7, 8) and other.correct


def test_a_forced_answer_is_wrong_when_any_of_its_positions_is():
    result = _forced(FORCED, {3: _dist({9: 0.6, 6: 0.3})})
    first, second = answers(FORCED, result)
    assert first.key == "1/0/record_reading/0"
    assert first.answer == (5, 9) and not first.correct
    assert second.correct


def test_a_forced_margin_is_the_least_gap_over_the_items_positions():
    result = _forced(FORCED, {2: _dist({5: 0.6, 9: 0.3}), 3: _dist({6: 0.9, 9: 0.05})})
    first, second = answers(FORCED, result)
    assert first.margin == pytest.approx(math.log(2.0))
    assert second.margin == pytest.approx(math.log(8.0))


def test_a_choice_answer_is_the_most_likely_candidate_even_below_another_token():
    dist = _dist({OTHER: 0.5, 10: 0.1, 11: 0.3, 12: 0.05})
    (answer,) = answers(CHOICE, ProbeResult(positions=(dist,)))
    assert answer.answer == 11 and answer.correct
    assert answer.margin == pytest.approx(math.log(3.0))  # 11 over 10; OTHER does not count


def test_a_choice_answer_other_than_the_truth_is_wrong():
    dist = _dist({OTHER: 0.5, 10: 0.3, 11: 0.1, 12: 0.05})
    (answer,) = answers(CHOICE, ProbeResult(positions=(dist,)))
    assert answer.answer == 10 and not answer.correct


def test_free_answers_are_the_numbers_extracted_after_each_name():
    text = "Record of round 1: Ann proposes 47 lanterns. Ben proposes 13. Ann proposes 50."
    found = answers(FREE, ProbeResult(text=text))
    assert [(a.key, a.answer, a.correct) for a in found] == [
        ("1/0/record_free/0", "47", True),
        ("1/0/record_free/1", "13", False),
        ("1/0/record_free/2", None, False),
    ]
    assert all(a.margin is None for a in found)


def test_a_row_missing_where_an_item_is_scored_names_the_item():
    with pytest.raises(ValueError, match="1/0/record_reading/1"):
        answers(FORCED, _forced(FORCED, {6: None}))
    with pytest.raises(ValueError, match="1/0/lookup/1"):
        answers(CHOICE, ProbeResult(positions=(None,)))


def test_a_row_missing_where_no_item_is_scored_is_left_out():
    result = _forced(FORCED, {1: None, 4: None})
    assert all(a.correct for a in answers(FORCED, result))
    assert [j for j, _ in scored_positions(FORCED, result)] == [2, 3, 5, 6]
    assert scored_positions(FREE, ProbeResult(text="Ann proposes 47")) == []


def test_accuracy_is_the_share_of_items_answered_right():
    text = "Ann proposes 47 lanterns. Ben proposes 12 lanterns."  # Cara missing
    results = [_forced(FORCED), ProbeResult(text=text)]
    assert accuracy([FORCED, FREE], results) == 4 / 5


# compare


PROBES = [FORCED, CHOICE, FREE]


def _full() -> list[ProbeResult]:
    """Full prefill: both forced items and the choice right; Ann and Ben right, Cara missing."""
    choice = ProbeResult(positions=(_dist({OTHER: 0.5, 10: 0.1, 11: 0.3, 12: 0.05}),))
    text = "Record of round 1: Ann proposes 47 lanterns. Ben proposes 12 lanterns."
    return [_forced(FORCED), choice, ProbeResult(text=text)]


def test_a_result_compared_with_itself_retains_and_agrees_on_everything():
    full = _full()
    figures = compare(PROBES, full, full)
    assert figures["items"] == 6
    assert figures["accuracy"] == round(5 / 6, 4)
    assert figures["retention"] == 1.0
    assert figures["retention_ci"] == [1.0, 1.0]
    assert figures["mcnemar"] == {"only_full": 0, "only_other": 0, "p_value": 1.0}
    assert figures["agreement"] == 1.0
    assert figures["agreement_by_margin"]["all"] == {"items": 6, "agreement": 1.0}
    assert figures["kl_mean"] == 0.0
    assert figures["token_agreement"] == 1.0


def test_one_item_wrong_shows_in_accuracy_mcnemar_and_agreement():
    full = _full()
    other = [_forced(FORCED, {3: _dist({9: 0.6, 6: 0.3})}), *full[1:]]
    figures = compare(PROBES, full, other)
    assert figures["items"] == 6
    assert figures["accuracy"] == round(4 / 6, 4)
    assert figures["retention"] == round(4 / 5, 4)
    assert figures["mcnemar"]["only_full"] == 1 and figures["mcnemar"]["only_other"] == 0
    assert figures["agreement"] == round(5 / 6, 4)
    # 7 scored positions: tail rows 1..6 of the forced probe and the choice's one.
    assert figures["token_agreement"] == round(6 / 7, 4)
    assert figures["kl_mean"] > 0.0


def test_the_wrong_item_falls_in_the_bin_of_full_prefills_margin():
    full = _full()
    # Full prefill is unsure at member 0's second digit (gap log(0.45 / 0.35) < 0.5 nats).
    full[0] = _forced(FORCED, {3: _dist({6: 0.45, 9: 0.35})})
    other = [_forced(FORCED, {3: _dist({9: 0.45, 6: 0.35})}), *full[1:]]
    by_margin = compare(PROBES, full, other)["agreement_by_margin"]
    assert by_margin["low"] == {"items": 1, "agreement": 0.0}
    assert by_margin["unknown"] == {"items": 3, "agreement": 1.0}  # the free items
    assert by_margin["all"] == {"items": 6, "agreement": 5 / 6}


def test_rows_only_one_side_computed_are_left_out_of_token_agreement():
    full = _full()
    # The strategy did not compute the separator row (index 4), which no item scores.
    other = [_forced(FORCED, {4: None}), *full[1:]]
    figures = compare(PROBES, full, other)
    assert figures["token_agreement"] == 1.0 and figures["kl_mean"] == 0.0
    assert figures["agreement"] == 1.0
