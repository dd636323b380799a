"""The agents' chat conversations of `kmesh bench agents` (src/kmesh/workloads/agent_chats.py)."""

import itertools

import pytest

from kmesh.compute.loader import load_tokenizer, resolve_model_dir
from kmesh.errors import InvalidRequestError
from kmesh.workloads.agent_chats import AgentChats, AgentsConfig, task_facts
from kmesh.workloads.allgather import AllGatherConfig, order_for
from kmesh.workloads.tasks import (
    NAMES,
    SYSTEM,
    WORDS,
    TaskCouncil,
    TasksConfig,
    extract_record,
    round_facts,
)


def count(text: str) -> list[str]:  # about one token per word: enough for these checks
    return text.split()


def run(cfg: AgentsConfig) -> list[list]:
    chats = AgentChats(cfg, count)
    rounds = []
    for r in range(cfg.rounds):
        calls = chats.calls()
        rounds.append(calls)
        chats.answer({c.agent: f"{c.agent} speaks in round {r}." for c in calls})
    return rounds


def test_every_agents_call_minus_its_last_message_starts_its_next_call():
    for workload in ("allgather", "trajectory", "mixed", "tasks"):
        rounds = run(AgentsConfig(workload, 6, rounds=3, seed=3, context_tokens=40))
        for before, after in itertools.pairwise(rounds):
            later = {c.agent: c.messages for c in after}
            for call in before:
                if call.kind == "plain":
                    assert call.agent not in later
                    continue
                kept = call.messages[:-1] if call.kind == "allgather" else call.messages
                assert later[call.agent][: len(kept)] == kept, (workload, call.agent)


def test_a_round_declares_the_previous_rounds_outputs_which_every_agent_reads():
    rounds = run(AgentsConfig("allgather", 4, rounds=3, seed=1))
    assert all(not c.round_outputs for c in rounds[0])
    for r, calls in enumerate(rounds[1:], start=1):
        for call in calls:
            assert call.round_outputs == tuple(f"out-{r - 1}-{k}" for k in range(4))
            ids = [m.id for m in call.messages]
            assert len(ids) == len(set(ids))
            assert set(call.round_outputs) <= set(ids)
            said = [m for m in call.messages if m.id in call.round_outputs]
            assert all(m.shared and m.content.startswith("Member ") for m in said)


def test_agents_read_a_round_in_their_own_orders_and_the_seed_changes_them():
    def orders(seed: int) -> list[list[str]]:
        [_, calls] = run(AgentsConfig("allgather", 5, rounds=2, seed=seed))
        return [[m.id for m in c.messages if m.id.startswith("out-")] for c in calls]

    assert len({tuple(o) for o in orders(0)}) > 1
    assert orders(0) != orders(1)


def test_trajectory_agents_arrive_staggered_and_mixed_splits_the_agents():
    [calls] = run(AgentsConfig("trajectory", 4, rounds=1, stagger_s=0.5, context_tokens=40))
    delays = [c.delay_s for c in calls]
    assert delays == sorted(delays) and delays[-1] >= 1.5
    [mixed] = run(AgentsConfig("mixed", 8, rounds=1, context_tokens=40))
    kinds = [c.kind for c in mixed]
    assert (kinds.count("allgather"), kinds.count("trajectory"), kinds.count("plain")) == (4, 4, 2)


def test_a_workload_it_cannot_build_is_refused_with_what_to_change():
    with pytest.raises(InvalidRequestError, match="--workload"):
        AgentsConfig("chess", 4)
    with pytest.raises(InvalidRequestError, match="--agents >= 2"):
        AgentsConfig("allgather", 1)
    with pytest.raises(InvalidRequestError, match=f"--agents must be between 2 and {len(NAMES)}"):
        AgentsConfig("tasks", len(NAMES) + 1)
    with pytest.raises(InvalidRequestError, match="--rounds must be at least 2"):
        AgentsConfig("tasks", 4, rounds=1)
    with pytest.raises(InvalidRequestError, match="--order"):
        AgentsConfig("tasks", 4, order="random")


# tasks: the council of workloads/tasks.py as chat


def test_tasks_calls_are_the_councils_messages_with_their_ids_roles_and_sharing():
    cfg = AgentsConfig("tasks", 3, rounds=3, seed=2)
    for r, calls in enumerate(run(cfg)):
        assert [c.agent for c in calls] == ["allgather-0", "allgather-1", "allgather-2"]
        for a, call in enumerate(calls):
            system, persona, *said, ask = call.messages
            assert (system.role, system.content, system.id, system.shared) == (
                "system",
                SYSTEM,
                "system",
                True,
            )
            assert (persona.role, persona.id, persona.shared) == ("user", f"persona-{a}", False)
            assert NAMES[a] in persona.content
            assert (ask.role, ask.id, ask.shared) == ("user", f"ask-{r}-{a}", False)
            assert all(m.role == "user" and m.shared for m in said)
            assert len(said) == 3 * r and call.kind == "allgather" and call.delay_s == 0


def test_tasks_agents_read_earlier_rounds_in_their_order_and_declare_the_last_one():
    cfg = AgentsConfig("tasks", 4, rounds=3, seed=5)
    council = AllGatherConfig(4, 3, "shuffle", 5)
    for r, calls in enumerate(run(cfg)):
        for a, call in enumerate(calls):
            expected = [f"out-{q}-{k}" for q in range(r) for k in order_for(council, q, a)]
            assert [m.id for m in call.messages[2:-1]] == expected
            assert call.round_outputs == tuple(f"out-{r - 1}-{k}" for k in range(4) if r)


def test_tasks_agents_read_each_rounds_composed_messages_with_its_facts():
    cfg = AgentsConfig("tasks", 5, rounds=3, seed=7)
    calls = run(cfg)[-1]
    tasks_cfg = TasksConfig(agents=5, rounds=3, seed=7)
    for q in range(2):
        facts = round_facts(tasks_cfg, q, WORDS)
        assert task_facts(cfg)[q] == facts
        for call in calls:
            read = {m.id: m.content for m in call.messages}
            for s in facts:
                content = read[f"out-{q}-{s.member}"]
                assert content == f"{NAMES[s.member]} said: {s.text}"
                assert extract_record(content) == {NAMES[s.member]: str(s.number)}
                assert f"{NAMES[s.member]}'s code word is {s.word}." in content


def test_tasks_asks_for_a_proposal_then_the_record_of_the_previous_round():
    rounds = run(AgentsConfig("tasks", 2, rounds=3))
    assert [c.messages[-1].content for c in rounds[0]] == [
        "Round 1. Ann, give your proposal.",
        "Round 1. Ben, give your proposal.",
    ]
    assert rounds[2][1].messages[-1].content == (
        "Round 3. Ben, write the record of round 2, then give your proposal."
    )


def test_tasks_answer_records_the_composed_messages_not_the_replies():
    cfg = AgentsConfig("tasks", 3, rounds=3, seed=1)
    chats = AgentChats(cfg, count)
    replies = []
    for r in range(cfg.rounds):
        calls = chats.calls()
        replies.append(calls)
        chats.answer({c.agent: f"a reply nobody reads {r}" for c in calls})
    assert replies == run(cfg)  # other replies, the same calls
    assert not any("nobody reads" in m.content for c in replies[-1] for m in c.messages)


@pytest.mark.model
def test_tasks_chats_are_the_task_benchs_prompts_where_every_code_word_is_one_token():
    tokenizer = load_tokenizer(resolve_model_dir(None))  # the embedded model: all 45 one token
    cfg = AgentsConfig("tasks", 4, rounds=3, seed=6)
    turns = TaskCouncil(cfg.tasks_config(), tokenizer).turns()
    calls = [c for calls in run(cfg) for c in calls]
    assert len(calls) == len(turns)
    for call, task_turn in zip(calls, turns, strict=True):
        messages = [{"role": m.role, "content": m.content} for m in call.messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert list(ids) == list(task_turn.turn.prompt.token_ids)
        assert [m.id for m in call.messages] == [
            s.segment_id for s in task_turn.turn.prompt.segments
        ]
