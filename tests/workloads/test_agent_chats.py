"""The agents' chat conversations of `kmesh bench agents` (src/kmesh/workloads/agent_chats.py)."""

import itertools

import pytest

from kmesh.errors import InvalidRequestError
from kmesh.workloads.agent_chats import AgentChats, AgentsConfig


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
    for workload in ("allgather", "trajectory", "mixed"):
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
