"""Task accuracy of the agents bench's tasks workload (src/kmesh/bench/agents/task_scores.py):
hand-made replies against hand-made facts, and a strategy against vllm's replies."""

import pytest

from kmesh.bench.agents.task_scores import record_items, task_scores
from kmesh.workloads.tasks import Said

# Round 0: Ann proposes 47, Ben 12, Cara 80 (rounds 1 and 2 are never a record's subject here).
FACTS = [
    [Said(0, 47, "red", "north", ""), Said(1, 12, "blue", "north", ""), Said(2, 80, "oak", "", "")],
    [],
]
RIGHT = "Record of round 1: Ann proposes 47 lanterns. Ben proposes 12 lanterns. Cara proposes 80."


def replies(*round_one: str) -> list[dict[str, str]]:
    """A 2-round run's texts: round 0's proposals (never scored), then these records."""
    return [
        {f"allgather-{a}": "I propose 99 lanterns." for a in range(len(round_one))},
        {f"allgather-{a}": text for a, text in enumerate(round_one)},
    ]


def test_a_record_with_every_number_right_scores_one():
    texts = replies(RIGHT, RIGHT)
    scores = task_scores(FACTS, texts, texts)
    assert scores == {
        "task_items": 6,  # 2 agents x 3 members of round 0
        "task_accuracy": 1.0,
        "task_retention": 1.0,
        "task_retention_ci": [1.0, 1.0],
        "task_agreement": 1.0,
    }


def test_a_record_in_another_order_or_with_more_words_is_still_right():
    reordered = "Cara proposes 80. Well, Ben proposes 12 lanterns and Ann proposes 47."
    assert all(i.correct for i in record_items(FACTS, replies(reordered)))


def test_a_record_missing_a_member_or_misreading_one_scores_less():
    missing = "Record of round 1: Ann proposes 47 lanterns. Ben proposes 12 lanterns."
    misread = "Record of round 1: Ann proposes 47 lanterns. Ben proposes 21. Cara proposes 80."
    items = record_items(FACTS, replies(missing, misread))
    assert [(i.agent, i.member, i.answer, i.correct) for i in items] == [
        ("allgather-0", 0, "47", True),
        ("allgather-0", 1, "12", True),
        ("allgather-0", 2, None, False),
        ("allgather-1", 0, "47", True),
        ("allgather-1", 1, "21", False),
        ("allgather-1", 2, "80", True),
    ]
    texts = replies(missing, misread)
    assert task_scores(FACTS, texts, texts)["task_accuracy"] == pytest.approx(4 / 6)


def test_round_zero_replies_are_not_scored_and_later_ones_read_the_round_before():
    facts = [
        FACTS[0],
        [Said(0, 30, "red", "", ""), Said(1, 31, "", "", ""), Said(2, 32, "", "", "")],
    ]
    texts = [*replies(RIGHT), {"allgather-0": "Ann proposes 30. Ben proposes 31. Cara proposes 9."}]
    items = record_items(facts, texts)
    assert [(i.round, i.member, i.truth, i.correct) for i in items] == [
        (1, 0, "47", True),
        (1, 1, "12", True),
        (1, 2, "80", True),
        (2, 0, "30", True),
        (2, 1, "31", True),
        (2, 2, "32", False),
    ]


def test_a_strategy_is_compared_with_vllms_answers_on_the_same_items():
    # vllm: 5 of 6 right (agent 1 misreads Ben). The strategy: 4 of 6 right, agent 0 forgets
    # Cara (vllm had her right), agent 1 reads Ben right (vllm did not) and misreads Ann.
    vllm = replies(RIGHT, "Ann proposes 47. Ben proposes 21. Cara proposes 80.")
    ours = replies(
        "Ann proposes 47. Ben proposes 12.", "Ann proposes 74. Ben proposes 12. Cara proposes 80."
    )
    scores = task_scores(FACTS, ours, vllm)
    assert scores["task_accuracy"] == pytest.approx(4 / 6)
    assert scores["task_retention"] == pytest.approx(4 / 5)
    low, high = scores["task_retention_ci"]
    assert low <= 4 / 5 <= high
    # Agreeing: agent 0's Ann and Ben, agent 1's Cara; Cara missing, Ann and Ben differ.
    assert scores["task_agreement"] == pytest.approx(3 / 6)


def test_retention_is_unknown_when_vllm_got_nothing_right():
    vllm = replies("I forgot.", "I forgot.")
    scores = task_scores(FACTS, replies(RIGHT, "I forgot."), vllm)
    assert scores["task_retention"] is None and scores["task_retention_ci"] is None
    assert scores["task_accuracy"] == 0.5 and scores["task_agreement"] == 0.5


def test_runs_of_different_calls_are_refused():
    with pytest.raises(ValueError, match="the same calls"):
        task_scores(FACTS, replies(RIGHT, RIGHT), replies(RIGHT))
