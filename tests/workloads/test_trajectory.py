"""Agent trajectories: each prompt minus its generation prompt extends into the next by one step
and one tool result, deterministic in the seed."""

import itertools

import pytest
from transformers import AutoTokenizer

from kmesh.compute.loader import resolve_model_dir
from kmesh.errors import InvalidRequestError
from kmesh.state.segments import Role
from kmesh.workloads.trace import load_trace, save_trace
from kmesh.workloads.trajectory import Trajectories, TrajectoryConfig

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def _turns(tokenizer, cfg: TrajectoryConfig):
    agents = Trajectories(cfg, tokenizer)
    turns = []
    for t in range(cfg.turns):
        prompts = agents.prompts()
        steps = [
            tokenizer(f"Step {t} of agent {a}: run the tests.")["input_ids"]
            for a in range(cfg.agents)
        ]
        turns += agents.answer(prompts, steps)
    return turns


def test_each_turn_appends_a_step_and_a_tool_result_to_the_last_prompt(tokenizer):
    cfg = TrajectoryConfig(agents=2, turns=3, tool_tokens=64)
    turns = _turns(tokenizer, cfg)
    by_agent = {a: [t for t in turns if t.agent == a] for a in range(2)}
    for own in by_agent.values():
        for before, after in itertools.pairwise(own):
            ask = before.prompt.segments[-1]
            assert ask.role is Role.INSTRUCTION
            held = before.prompt.token_ids[: len(before.prompt.token_ids) - len(ask.token_ids)]
            assert after.prompt.token_ids[: len(held)] == held
            appended = len(after.prompt.token_ids) - len(before.prompt.token_ids)
            step, tool = after.prompt.segments[-3], after.prompt.segments[-2]
            assert step.token_ids[-len(before.output_ids) - 2 : -2] == before.output_ids
            assert 64 <= len(tool.token_ids) < 64 + 40  # a tool result of about tool_tokens
            assert appended == len(step.token_ids) + len(tool.token_ids)
    assert by_agent[0][1].prompt.segments[-2].text != by_agent[1][1].prompt.segments[-2].text
    assert _turns(tokenizer, cfg)[-1].prompt.token_ids == turns[-1].prompt.token_ids  # seeded


def test_a_trajectory_trace_round_trips_and_bad_configs_are_refused(tokenizer, tmp_path):
    cfg = TrajectoryConfig(agents=2, turns=2, tool_tokens=32)
    turns = _turns(tokenizer, cfg)
    save_trace(tmp_path / "t.jsonl", cfg, "f" * 64, turns)
    loaded_cfg, model, loaded = load_trace(tmp_path / "t.jsonl")
    assert loaded_cfg == cfg and model == "f" * 64
    assert [t.prompt.token_ids for t in loaded] == [t.prompt.token_ids for t in turns]
    with pytest.raises(InvalidRequestError, match="turns >= 2"):
        TrajectoryConfig(agents=2, turns=1)
