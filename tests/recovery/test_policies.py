from typing import get_args

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from kmesh.recovery.policies import POLICIES, needs_check_layer, needs_queries, select
from kmesh.state.recovery_meta import RecoverySpec

SEGMENTS = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])


def test_none_and_full():
    assert select("none", 5, SEGMENTS).tolist() == []
    assert select("full", 0, SEGMENTS).tolist() == list(range(9))


def test_first_k_gives_every_segment_its_first_units_first():
    assert select("first_k", 3, SEGMENTS).tolist() == [0, 3, 5]
    assert select("first_k", 5, SEGMENTS).tolist() == [0, 1, 3, 4, 5]
    assert select("first_k", 9, SEGMENTS).tolist() == list(range(9))


def test_kv_deviation_takes_the_largest_deviations():
    deviation = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.0, 0.3, 0.7, 0.4, 0.5])
    assert select("kv_deviation", 3, SEGMENTS, deviation).tolist() == [1, 3, 6]
    with pytest.raises(ValueError, match="deviation"):
        select("kv_deviation", 3, SEGMENTS)


def test_random_spends_the_same_budget_reproducibly():
    a = select("random", 4, SEGMENTS, seed=1)
    assert len(a) == 4 and len(set(a.tolist())) == 4
    assert torch.equal(a, select("random", 4, SEGMENTS, seed=1))
    picks = {tuple(select("random", 4, SEGMENTS, seed=s).tolist()) for s in range(10)}
    assert len(picks) > 1


def test_budget_is_clamped_and_unknown_policies_refused():
    assert len(select("first_k", 100, SEGMENTS)) == 9
    with pytest.raises(ValueError, match="unknown recovery policy"):
        select("best", 1, SEGMENTS)


def test_query_takes_the_largest_attention_scores():
    attention = torch.tensor([0.3, 0.0, 0.1, 0.9, 0.2, 0.8, 0.05, 0.4, 0.01])
    assert select("query", 3, SEGMENTS, attention=attention).tolist() == [3, 5, 7]
    with pytest.raises(ValueError, match="attention"):
        select("query", 3, SEGMENTS)
    with pytest.raises(ValueError, match="attention"):
        select("query", 3, SEGMENTS, attention=attention[:4])


def test_a_combination_gives_first_k_half_the_budget_rounded_up_and_ranks_the_rest():
    scores = torch.tensor([0.9, 0.8, 0.1, 0.7, 0.0, 0.6, 0.2, 0.3, 0.5])
    # budget 5: first_k takes 3 (units 0, 3, 5); the 2 best of the rest are 1 and 8
    assert select("first_k+query", 5, SEGMENTS, attention=scores).tolist() == [0, 1, 3, 5, 8]
    assert select("first_k+kv_deviation", 5, SEGMENTS, scores).tolist() == [0, 1, 3, 5, 8]
    # budget 1: first_k's unit alone
    assert select("first_k+query", 1, SEGMENTS, attention=scores).tolist() == [0]
    with pytest.raises(ValueError, match="deviation"):
        select("first_k+kv_deviation", 5, SEGMENTS, attention=scores)
    with pytest.raises(ValueError, match="attention"):
        select("first_k+query", 5, SEGMENTS, scores)


def test_which_policies_need_the_check_layer_or_the_queries():
    assert [p for p in POLICIES if needs_check_layer(p)] == ["kv_deviation", "first_k+kv_deviation"]
    assert [p for p in POLICIES if needs_queries(p)] == ["query", "first_k+query"]


def test_a_request_may_ask_for_every_policy_and_no_other():
    assert get_args(RecoverySpec.model_fields["policy"].annotation) == POLICIES
    for policy in POLICIES:
        assert RecoverySpec(policy=policy).policy == policy
    with pytest.raises(ValidationError):
        RecoverySpec(policy="first_k+random")


@st.composite
def _units(draw):
    """Segment lengths, a budget and one distinct score per unit."""
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=6))
    segments = torch.cat([torch.full((n,), s) for s, n in enumerate(lengths)])
    units = len(segments)
    scores = torch.tensor(draw(st.permutations(range(units))), dtype=torch.float32)
    return segments, draw(st.integers(0, units + 2)), scores


@given(_units())
def test_a_ranking_rule_takes_its_top_units(case):
    segments, budget, scores = case
    chosen = select("query", budget, segments, attention=scores)
    assert chosen.tolist() == sorted(torch.topk(scores, min(budget, len(scores))).indices.tolist())


@given(_units(), st.sampled_from(["first_k+query", "first_k+kv_deviation"]))
def test_a_combination_is_first_k_s_half_and_the_top_of_the_rest(case, policy):
    segments, budget, scores = case
    chosen = select(policy, budget, segments, scores, scores).tolist()
    spent = min(budget, len(segments))
    assert chosen == sorted(set(chosen)) and len(chosen) == spent
    first = select("first_k", (spent + 1) // 2, segments).tolist()
    assert set(first) <= set(chosen)
    rest = [u for u in range(len(segments)) if u not in first]
    best = sorted(rest, key=lambda u: -float(scores[u]))[: spent - len(first)]
    assert set(chosen) - set(first) == set(best)
