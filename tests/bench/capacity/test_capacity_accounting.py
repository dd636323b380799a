"""The capacity bench's own arithmetic: an ideal prefix cache, the agent counts within a limit."""

from kmesh.bench.capacity.accounting import ideal_prefix_cache, max_agents
from kmesh.state.segments import Role, Segment, SegmentedPrompt
from kmesh.workloads.allgather import AgentTurn


def _turn(r: int, a: int, tokens: list[int]) -> AgentTurn:
    prompt = SegmentedPrompt.of([Segment(tuple(tokens), Role.PRIVATE, f"s{r}{a}")])
    return AgentTurn(r, a, prompt, (), "")


def test_an_ideal_prefix_cache_reuses_whole_pages_any_earlier_prompt_had():
    shared = list(range(64))  # two whole pages every prompt starts with
    rounds = [
        [_turn(0, 0, [*shared, 1, 2]), _turn(0, 1, [*shared, 3])],
        [_turn(1, 0, [*shared, 1, 2, *range(100, 140)]), _turn(1, 1, [*shared, 5])],
    ]
    # round 0: the first prompt computes all, the second reuses its two pages; round 1: both
    # reuse the shared pages (the first's third page, 1, 2, ..., was never whole before).
    assert ideal_prefix_cache(rounds) == [66 + 1, 42 + 1]


def test_max_agents_is_the_last_count_before_a_round_first_exceeds_the_limit():
    runs = [
        {"agents": a, "computed_tokens_per_round": c, "new_tokens_per_round": [100, 100]}
        for a, c in ((4, [100, 150]), (8, [100, 200]), (16, [100, 201]), (32, [100, 150]))
    ]
    assert max_agents({"runs": runs}, "new_tokens_per_round", 2.0) == 8
    assert max_agents({"runs": runs[2:]}, "new_tokens_per_round", 2.0) is None
    assert max_agents({"error": "did not run"}, "new_tokens_per_round", 2.0) is None
