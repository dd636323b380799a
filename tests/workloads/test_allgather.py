"""The All-Gather workload: deterministic, prefix-extending, exact output tokens, replayable."""

import pytest

from kmesh.engine.engine import Engine
from kmesh.errors import InvalidRequestError
from kmesh.state.segments import Role
from kmesh.workloads.allgather import AllGatherConfig, generate_trace, order_for
from kmesh.workloads.trace import load_trace, save_trace


def test_orders_are_permutations_fixed_by_the_seed():
    cfg = AllGatherConfig(agents=6, rounds=2, order="shuffle", seed=3)
    orders = [order_for(cfg, 0, a) for a in range(6)]
    assert all(sorted(o) == list(range(6)) for o in orders)
    assert len({tuple(o) for o in orders}) > 1
    assert orders == [order_for(cfg, 0, a) for a in range(6)]
    rotate = AllGatherConfig(agents=4, rounds=1, order="rotate")
    assert order_for(rotate, 0, 1) == [1, 2, 3, 0]
    assert order_for(AllGatherConfig(4, 1, "same"), 0, 2) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "options",
    [
        {"agents": 1, "rounds": 2},
        {"agents": 3, "rounds": 0},
        {"agents": 3, "rounds": 1, "order": "random"},
    ],
)
def test_bad_configs_are_refused(options):
    with pytest.raises(InvalidRequestError):
        AllGatherConfig(**options)


def test_a_file_that_is_not_a_trace_is_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"hello": 1}\n')
    with pytest.raises(InvalidRequestError, match="not a trace"):
        load_trace(path)
    with pytest.raises(InvalidRequestError, match="does not exist"):
        load_trace(tmp_path / "missing.jsonl")


@pytest.fixture(scope="module")
def trace(real_model):
    cfg = AllGatherConfig(agents=3, rounds=3, order="shuffle", seed=1, output_tokens=8)
    engine = Engine(real_model.executor, real_model.fingerprint)
    return cfg, generate_trace(cfg, engine, real_model.tokenizer)


@pytest.mark.model
def test_each_prompt_minus_its_instruction_is_a_prefix_of_the_next(trace):
    cfg, turns = trace
    by_key = {(t.round, t.agent): t for t in turns}
    for r in range(cfg.rounds - 1):
        for a in range(cfg.agents):
            now, later = by_key[(r, a)].prompt, by_key[(r + 1, a)].prompt
            assert now.segments[-1].role is Role.INSTRUCTION
            head = now.segments[:-1]
            assert later.segments[: len(head)] == head


@pytest.mark.model
def test_outputs_appear_with_their_authors_exact_tokens_in_each_agents_order(trace):
    cfg, turns = trace
    by_key = {(t.round, t.agent): t for t in turns}
    for a in range(cfg.agents):
        prompt = by_key[(1, a)].prompt
        outputs = [s for s in prompt.segments if s.segment_id and s.segment_id.startswith("out-0-")]
        assert [s.segment_id for s in outputs] == [f"out-0-{k}" for k in order_for(cfg, 0, a)]
        for segment in outputs:
            author = int(segment.segment_id.rsplit("-", 1)[1])
            generated = by_key[(0, author)].output_ids
            runs = [
                segment.token_ids[i : i + len(generated)]
                for i in range(len(segment.token_ids) - len(generated) + 1)
            ]
            assert generated in runs
    # The same output is the same segment in every agent's prompt.
    segments = [s for t in turns for s in t.prompt.segments]
    ids = {}
    for s in segments:
        if s.segment_id:
            assert ids.setdefault(s.segment_id, s.token_ids) == s.token_ids


@pytest.mark.model
def test_first_round_prompts_are_the_models_own_chat_template(trace, real_model):
    _, turns = trace
    first = turns[0]
    messages = [{"role": s.message_role, "content": s.text} for s in first.prompt.segments]
    expected = real_model.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert list(first.prompt.token_ids) == list(expected)


@pytest.mark.model
def test_a_trace_replays_exactly_from_its_file(trace, real_model, tmp_path):
    cfg, turns = trace
    path = tmp_path / "trace.jsonl"
    save_trace(path, cfg, real_model.fingerprint, turns)
    loaded_cfg, model, loaded = load_trace(path)
    assert loaded_cfg == cfg and model == real_model.fingerprint
    assert loaded == turns
