"""The three callers of the fork on the tiny model."""

import pytest

from kmesh.engine.request import SamplingParams
from kmesh.errors import ContractError
from kmesh.workloads.branching import best_of_n, chain_of_thought, mean_logprob, tree_search
from tests.conftest import random_tokens

PROMPT = random_tokens(29, seed=3)
PARAMS = SamplingParams(max_tokens=6, temperature=1.0, stop_token_ids=())


def test_best_of_n_gives_one_sample_per_seed(make_tiny_engine):
    engine = make_tiny_engine()
    result = best_of_n(engine, "b", PROMPT, [5, 6, 5], PARAMS)
    outs = [b.output_ids for b in result.branches]
    assert outs[0] == outs[2] and outs[0] != outs[1]
    assert engine.kv.num_blocks_in_use == 0


def test_chain_of_thought_forks_after_the_reasoning(make_tiny_engine):
    engine = make_tiny_engine()
    reasoning = SamplingParams(max_tokens=7, stop_token_ids=())
    result = chain_of_thought(engine, "c", PROMPT, reasoning, [1, 2], PARAMS)
    assert len(result.trunk.output_ids) == 7
    for out in result.branches:
        assert out.prompt_ids == tuple(PROMPT) + result.trunk.output_ids


def test_tree_search_keeps_the_leaf_with_the_best_mean_logprob(make_tiny_engine):
    engine = make_tiny_engine()
    tree = tree_search(engine, "t", PROMPT, 3, PARAMS, seed=4)
    scores = {
        (i, j): mean_logprob(tree.nodes[i], tree.leaves[i][j]) for i in range(3) for j in range(3)
    }
    assert tree.best == max(scores, key=scores.__getitem__)
    for i, node in enumerate(tree.nodes):
        for leaf in tree.leaves[i]:
            assert leaf.prompt_ids == tuple(PROMPT) + node.output_ids
    assert engine.kv.num_blocks_in_use == 0
    # 29 prompt tokens once, 3 nodes x 6 tokens, 9 leaves x 5 of their own tokens.
    assert engine.counters.computed_tokens == 29 + 3 * 6 + 9 * 5


def test_a_family_name_is_declared_once_per_engine(make_tiny_engine):
    engine = make_tiny_engine()
    best_of_n(engine, "b", PROMPT, [1], PARAMS)
    with pytest.raises(ContractError, match="already declared"):
        best_of_n(engine, "b", PROMPT, [1], PARAMS)
    best_of_n(make_tiny_engine(), "b", PROMPT, [1], PARAMS)
