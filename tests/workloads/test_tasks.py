"""All-Gather councils with ground truth: facts distinct within a round and fixed by the seed,
prompts in the model's own chat template, probes whose items point at the truth."""

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kmesh.compute.loader import load_tokenizer, resolve_model_dir
from kmesh.errors import InvalidRequestError
from kmesh.workloads.allgather import order_for, output_segment_id
from kmesh.workloads.chatml import ChatML
from kmesh.workloads.tasks import (
    FILLER,
    KINDS,
    LOOKUPS,
    NAMES,
    OPTIONS,
    SYSTEM,
    TASKS,
    WORDS,
    Probe,
    TaskCouncil,
    TasksConfig,
    extract_record,
    round_facts,
    winner,
)

seeds = st.integers(0, 10**6)
agent_counts = st.integers(2, len(NAMES))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The embedded SmolLM2 model's tokenizer (no weights)."""
    return load_tokenizer(resolve_model_dir(None))


@pytest.fixture(scope="module")
def chat(tokenizer: Any) -> ChatML:
    return ChatML(tokenizer)


def _member(key: str) -> int:
    """The member an item's key ends in ("r/a/task/member")."""
    return int(key.rsplit("/", 1)[1])


def _sentences(text: str) -> list[str]:
    return re.findall(r"[^.]+\.", text)


# facts


@settings(deadline=None)
@given(seed=seeds, agents=agent_counts, r=st.integers(0, 5))
def test_numbers_and_code_words_are_distinct_within_a_round(seed, agents, r):
    said = round_facts(TasksConfig(agents=agents, seed=seed), r, WORDS)
    assert [s.member for s in said] == list(range(agents))
    numbers = [s.number for s in said]
    assert len(set(numbers)) == agents and all(10 <= n <= 99 for n in numbers)
    words = [s.word for s in said]
    assert len(set(words)) == agents and set(words) <= set(WORDS)
    assert {s.vote for s in said} <= set(OPTIONS)


@settings(deadline=None)
@given(seed=seeds, agents=agent_counts, r=st.integers(0, 5))
def test_one_vote_option_wins_outright(seed, agents, r):
    said = round_facts(TasksConfig(agents=agents, seed=seed), r, WORDS)
    votes = [s.vote for s in said]
    best = winner(said)
    assert all(votes.count(best) > votes.count(o) for o in OPTIONS if o != best)


@settings(deadline=None)
@given(seed=seeds, agents=agent_counts, filler=st.integers(0, len(FILLER)))
def test_each_message_states_its_facts_among_the_filler(seed, agents, filler):
    for s in round_facts(TasksConfig(agents=agents, seed=seed, filler=filler), 1, WORDS):
        name = NAMES[s.member]
        facts = [
            f"{name} proposes {s.number} lanterns.",
            f"{name}'s code word is {s.word}.",
            f"{name} votes {s.vote}.",
        ]
        sentences = [x.strip() for x in _sentences(s.text)]
        assert [x for x in sentences if x in facts] == facts
        others = [x for x in sentences if x not in facts]
        assert len(others) == filler and len(set(others)) == filler
        assert set(others) <= set(FILLER)
        assert extract_record(s.text) == {name: str(s.number)}


def test_the_same_seed_gives_the_same_facts_and_another_seed_different_ones():
    cfg = TasksConfig(agents=8, seed=4)
    first = [round_facts(cfg, r, WORDS) for r in range(3)]
    assert first == [round_facts(TasksConfig(agents=8, seed=4), r, WORDS) for r in range(3)]
    other = [round_facts(TasksConfig(agents=8, seed=5), r, WORDS) for r in range(3)]
    for mine, theirs in zip(first, other, strict=True):
        assert [s.number for s in mine] != [s.number for s in theirs]
        assert [s.word for s in mine] != [s.word for s in theirs]
    assert [s.number for s in first[0]] != [s.number for s in first[1]]  # rounds differ too


@pytest.mark.model
def test_the_same_seed_gives_the_same_turns_and_probes(tokenizer):
    cfg = TasksConfig(agents=4, rounds=3, seed=11)
    turns = TaskCouncil(cfg, tokenizer).turns()
    assert turns == TaskCouncil(TasksConfig(agents=4, rounds=3, seed=11), tokenizer).turns()
    other = TaskCouncil(TasksConfig(agents=4, rounds=3, seed=12), tokenizer).turns()
    assert [t.probes for t in turns] != [t.probes for t in other]


# prompts


@pytest.mark.model
@pytest.mark.parametrize("order", ["shuffle", "rotate", "same"])
def test_every_prompt_is_its_segments_in_reading_order_and_the_models_chat_template(
    tokenizer, order
):
    cfg = TasksConfig(agents=4, rounds=3, order=order, seed=2)
    council = TaskCouncil(cfg, tokenizer)
    turns = council.turns()
    assert [(t.turn.round, t.turn.agent) for t in turns] == [
        (r, a) for r in range(cfg.rounds) for a in range(cfg.agents)
    ]
    for task_turn in turns:
        r, a, prompt = task_turn.turn.round, task_turn.turn.agent, task_turn.turn.prompt
        said = [(q, k) for q in range(r) for k in order_for(cfg.council, q, a)]
        expected_ids = [
            "system",
            f"persona-{a}",
            *(output_segment_id(q, k) for q, k in said),
            f"ask-{r}-{a}",
        ]
        assert [s.segment_id for s in prompt.segments] == expected_ids
        assert prompt.token_ids == tuple(t for s in prompt.segments for t in s.token_ids)
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"You are {NAMES[a]}, member {a + 1} of the council."},
            *(
                {"role": "user", "content": f"{NAMES[k]} said: {council.rounds[q][k].text}"}
                for q, k in said
            ),
            {"role": "user", "content": prompt.segments[-1].text},
        ]
        expected = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert list(prompt.token_ids) == list(expected)


@pytest.mark.model
def test_round_zero_has_no_probes_and_later_turns_one_per_task_plus_lookups(tokenizer):
    cfg = TasksConfig(agents=5, rounds=3, seed=1)
    for task_turn in TaskCouncil(cfg, tokenizer).turns():
        probes = task_turn.probes
        if task_turn.turn.round == 0:
            assert probes == ()
            continue
        tasks = [p.task for p in probes]
        assert sorted(tasks) == sorted(
            [*(t for t in TASKS if t != "lookup"), *["lookup"] * LOOKUPS]
        )
        assert all(
            p.round == task_turn.turn.round and p.agent == task_turn.turn.agent for p in probes
        )
        assert all(p.kind == KINDS[p.task] for p in probes)


# probes


def _probes(council: TaskCouncil, r: int, a: int, task: str) -> list[Probe]:
    return [p for p in council.probes(r, a) if p.task == task]


@pytest.mark.model
@settings(deadline=None, max_examples=20)
@given(seed=seeds, agents=agent_counts, r=st.integers(1, 2))
def test_forced_items_read_the_members_numbers_in_reading_and_member_order(
    tokenizer, chat, seed, agents, r
):
    cfg = TasksConfig(agents=agents, rounds=3, seed=seed)
    council = TaskCouncil(cfg, tokenizer)
    said = council.rounds[r - 1]
    for a in range(agents):
        orders = {
            "record_reading": (order_for(cfg.council, r - 1, a), "Record of round"),
            "record_members": (list(range(agents)), "Members' record of round"),
        }
        for task, (order, head) in orders.items():
            (probe,) = _probes(council, r, a, task)
            record = " ".join(f"{NAMES[k]} proposes {said[k].number} lanterns." for k in order)
            assert chat.decode(probe.tail) == f"{head} {r}: {record}"
            assert [_member(i.key) for i in probe.items] == order
            for item, k in zip(probe.items, order, strict=True):
                assert item.positions and min(item.positions) >= 1
                assert tuple(probe.tail[j] for j in item.positions) == item.truth
                assert chat.decode(item.truth) == str(said[k].number)
                before = chat.decode(probe.tail[: item.positions[0]])
                assert before.endswith(f"{NAMES[k]} proposes")


@pytest.mark.model
@settings(deadline=None, max_examples=20)
@given(seed=seeds, agents=agent_counts, r=st.integers(1, 2))
def test_choice_items_truth_is_one_of_their_one_token_candidates(tokenizer, chat, seed, agents, r):
    council = TaskCouncil(TasksConfig(agents=agents, rounds=3, seed=seed), tokenizer)
    said = council.rounds[r - 1]
    codes = tuple(chat.tokens(f" {s.word}") for s in said)
    assert all(len(c) == 1 for c in codes)
    options = tuple(chat.tokens(f" {o}") for o in OPTIONS)
    assert all(len(o) == 1 for o in options)
    for a in range(agents):
        lookups = _probes(council, r, a, "lookup")
        members = [_member(p.items[0].key) for p in lookups]
        assert len(members) == min(LOOKUPS, agents) == len(set(members))
        for probe, k in zip(lookups, members, strict=True):
            (item,) = probe.items
            assert chat.decode(probe.tail) == f"Lookup for round {r}: {NAMES[k]}'s code word is"
            assert item.candidates == tuple(c[0] for c in codes)
            assert item.truth == codes[k] and item.truth[0] in item.candidates
        (aggregate,) = _probes(council, r, a, "aggregate")
        (item,) = aggregate.items
        assert chat.decode(aggregate.tail) == f"Vote of round {r}: the vote was won by"
        assert item.candidates == tuple(o[0] for o in options)
        assert item.truth == chat.tokens(f" {winner(said)}") and item.truth[0] in item.candidates


@pytest.mark.model
def test_free_items_name_the_members_and_their_numbers(tokenizer, chat):
    council = TaskCouncil(TasksConfig(agents=6, rounds=3, seed=9), tokenizer)
    for r in (1, 2):
        said = council.rounds[r - 1]
        for a in range(6):
            (probe,) = _probes(council, r, a, "record_free")
            assert chat.decode(probe.tail) == f"Minutes of round {r}:"
            assert [(i.name, i.truth) for i in probe.items] == [
                (NAMES[s.member], str(s.number)) for s in said
            ]
            assert [_member(i.key) for i in probe.items] == list(range(6))


def test_extract_record_reads_names_and_numbers_and_keeps_the_first_mention():
    assert extract_record("Ann proposes 47 lanterns. Ben proposes 12") == {"Ann": "47", "Ben": "12"}
    assert extract_record("Ann proposes 47 lanterns. Ann proposes 50 lanterns.") == {"Ann": "47"}
    # The model's own formats: the number follows the name on its line.
    assert extract_record("\n\nAnn, 51 lanterns\nBen: 28\nCara - 9") == {
        "Ann": "51",
        "Ben": "28",
        "Cara": "9",
    }
    # A number belongs to the last name before it, not to one on an earlier line.
    assert extract_record("Ann\nBen proposes 12") == {"Ben": "12"}
    assert extract_record("Ann proposes nothing. nobody proposes anything") == {}


# refusals


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        ({"agents": 1}, "--agents"),
        ({"agents": len(NAMES) + 1}, "--agents"),
        ({"rounds": 1}, "--rounds"),
        ({"filler": -1}, "--filler"),
        ({"filler": len(FILLER) + 1}, "--filler"),
        ({"order": "random"}, "--order"),
    ],
)
def test_bad_configs_are_refused_naming_the_flag(options, flag):
    with pytest.raises(InvalidRequestError, match=flag):
        TasksConfig(**options)


class SplittingTokenizer:
    """The real tokenizer, except that the words in `split` (after a space) come out as two
    tokens each (every token of theirs twice)."""

    def __init__(self, tokenizer: Any, split: set[str]) -> None:
        self._tokenizer = tokenizer
        self._split = split

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self._tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if text.strip() in self._split:
            ids = [t for t in ids for _ in range(2)]
        return {"input_ids": ids}

    def convert_tokens_to_ids(self, token: str) -> int:
        return self._tokenizer.convert_tokens_to_ids(token)

    def decode(self, ids: list[int], **options: Any) -> str:
        return self._tokenizer.decode(ids, **options)


@pytest.mark.model
def test_a_tokenizer_that_splits_the_code_words_is_refused(tokenizer):
    with pytest.raises(InvalidRequestError, match="one-token"):
        TaskCouncil(TasksConfig(agents=2), SplittingTokenizer(tokenizer, set(WORDS)))


@pytest.mark.model
def test_a_tokenizer_that_splits_an_option_is_refused(tokenizer):
    with pytest.raises(InvalidRequestError, match="one-token"):
        TaskCouncil(TasksConfig(agents=2), SplittingTokenizer(tokenizer, {OPTIONS[-1]}))


@pytest.mark.model
def test_a_council_needs_one_one_token_code_word_per_member(tokenizer):
    split = set(WORDS[4:])  # four one-token words left
    council = TaskCouncil(TasksConfig(agents=4), SplittingTokenizer(tokenizer, split))
    assert council.words == list(WORDS[:4])
    with pytest.raises(InvalidRequestError, match="one-token"):
        TaskCouncil(TasksConfig(agents=5), SplittingTokenizer(tokenizer, split))


@pytest.mark.model
def test_no_two_probes_of_a_turn_start_alike(tokenizer):
    """A probe's tail shares no page with another probe's of its turn (an engine's prefix cache
    would give it rows its own request must compute)."""
    council = TaskCouncil(TasksConfig(agents=4, rounds=3, seed=2), tokenizer)
    for r in (1, 2):
        for a in range(4):
            probes = council.probes(r, a)
            # Lookups may share their start: a choice is read after the whole tail, from the
            # row the engine computes last whatever it cached.
            firsts = {p.task: p.tail[0] for p in probes}
            assert len(set(firsts.values())) == len(firsts)
