import pytest
import torch

from kmesh.recovery.policies import select

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
