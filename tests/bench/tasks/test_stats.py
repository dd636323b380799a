"""Paired statistics of kmesh bench tasks: retention, McNemar, coarse KL, margins."""

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from kmesh.bench.tasks.stats import (
    MARGIN_BINS,
    McNemar,
    agreement_by_margin,
    coarse_kl,
    margin,
    margin_bin,
    mcnemar,
    retention,
    retention_interval,
)

pairs = st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=200)
logits = st.lists(st.floats(-8.0, 8.0), min_size=2, max_size=30)


def _log_softmax(values: list[float]) -> list[float]:
    return torch.log_softmax(torch.tensor(values, dtype=torch.float64), dim=0).tolist()


def _two_distributions(data: st.DataObject) -> tuple[list[float], list[float]]:
    """Log probabilities of two random next-token distributions over one small vocabulary."""
    n = data.draw(st.integers(2, 30))
    values = st.lists(st.floats(-8.0, 8.0), min_size=n, max_size=n)
    return _log_softmax(data.draw(values)), _log_softmax(data.draw(values))


def _exact_kl(log_p: list[float], log_q: list[float]) -> float:
    """KL(P || Q) over the whole vocabulary, by torch's kl_div (target P, input Q)."""
    return torch.nn.functional.kl_div(
        torch.tensor(log_q, dtype=torch.float64),
        torch.tensor(log_p, dtype=torch.float64),
        reduction="sum",
        log_target=True,
    ).item()


def _top(log_probs: list[float], k: int) -> dict[int, float]:
    order = sorted(range(len(log_probs)), key=lambda token: -log_probs[token])
    return {token: log_probs[token] for token in order[:k]}


def _binomial_tail_reference(only_full: int, only_other: int) -> float:
    """2 * P[X <= min(b, c)] for X ~ Bin(b + c, 1/2), by torch's Binomial, capped at 1."""
    n = only_full + only_other
    if n == 0:
        return 1.0
    dist = torch.distributions.Binomial(n, torch.tensor(0.5, dtype=torch.float64))
    ks = torch.arange(min(only_full, only_other) + 1, dtype=torch.float64)
    return min(1.0, 2 * torch.logsumexp(dist.log_prob(ks), dim=0).exp().item())


# retention and its interval


def test_retention_is_the_ratio_of_correct_answers():
    full = [True, True, True, True, False]
    other = [True, False, True, False, True]
    assert retention(full, other) == 3 / 4


def test_retention_is_none_when_full_prefill_never_answers_right():
    assert retention([False, False], [True, False]) is None
    assert retention([], []) is None


@given(pairs)
def test_the_interval_contains_the_point_estimate(items):
    full, other = [f for f, _ in items], [o for _, o in items]
    assume(any(full))
    point = retention(full, other)
    interval = retention_interval(full, other, resamples=500)
    assert point is not None and interval is not None
    assert interval[0] <= point <= interval[1]


@given(st.lists(st.booleans(), min_size=1, max_size=200))
def test_the_interval_is_one_when_the_strategy_answers_as_full_prefill(full):
    assume(any(full))
    assert retention_interval(full, list(full), resamples=200) == (1.0, 1.0)


def test_the_interval_is_deterministic_in_the_seed():
    full = [i % 3 != 0 for i in range(300)]
    other = [i % 5 != 0 for i in range(300)]
    first = retention_interval(full, other, seed=7)
    assert first == retention_interval(full, other, seed=7)
    assert first != retention_interval(full, other, seed=8)


def test_a_higher_level_gives_a_wider_interval():
    full = [i % 3 != 0 for i in range(300)]
    other = [i % 5 != 0 for i in range(300)]
    narrow = retention_interval(full, other, level=0.5)
    wide = retention_interval(full, other, level=0.99)
    assert narrow is not None and wide is not None
    assert wide[0] < narrow[0] and narrow[1] < wide[1]


def test_the_interval_is_none_when_full_prefill_never_answers_right():
    assert retention_interval([False] * 10, [True] * 10) is None
    assert retention_interval([], []) is None


def test_a_large_bench_gives_a_tight_interval_around_the_retention():
    generator = torch.Generator().manual_seed(0)
    full = (torch.rand(5000, generator=generator) < 0.8).tolist()
    flipped = (torch.rand(5000, generator=generator) < 0.1).tolist()
    other = [f and not x for f, x in zip(full, flipped, strict=True)]
    point = retention(full, other)
    interval = retention_interval(full, other)
    assert point is not None and interval is not None
    assert interval[0] < point < interval[1]
    # Binomial standard error of a ~0.9 share of ~4000 items is ~0.005: +-1.96 of it is ~0.019.
    assert interval[1] - interval[0] < 0.03


def test_lists_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="same items"):
        retention_interval([True, False], [True])
    with pytest.raises(ValueError, match="same items"):
        mcnemar([True], [True, False])


@pytest.mark.parametrize(("keyword", "value"), [("level", 1.0), ("level", 0.0), ("resamples", 0)])
def test_an_invalid_bootstrap_setting_is_refused(keyword, value):
    with pytest.raises(ValueError, match=keyword):
        retention_interval([True], [True], **{keyword: value})


# McNemar


def _scorings(only_full: int, only_other: int, both: int = 4, neither: int = 3):
    full = [True] * only_full + [False] * only_other + [True] * both + [False] * neither
    other = [False] * only_full + [True] * only_other + [True] * both + [False] * neither
    return full, other


@pytest.mark.parametrize(
    ("only_full", "only_other", "p_value"),
    [
        (0, 5, 0.0625),  # 2 * 1/32
        (3, 3, 1.0),  # 2 * 42/64 capped at 1
        (1, 9, 0.021484375),  # 2 * (1 + 10)/1024
        (0, 0, 1.0),  # no discordant item
    ],
)
def test_mcnemar_matches_hand_computed_values(only_full, only_other, p_value):
    assert mcnemar(*_scorings(only_full, only_other)) == McNemar(only_full, only_other, p_value)


@given(st.integers(0, 300), st.integers(0, 300))
def test_mcnemar_matches_the_binomial_tail_reference(only_full, only_other):
    p_value = mcnemar(*_scorings(only_full, only_other)).p_value
    assert p_value == pytest.approx(_binomial_tail_reference(only_full, only_other), rel=1e-9)


@given(pairs)
def test_mcnemar_is_symmetric_in_swapping_the_sides(items):
    full, other = [f for f, _ in items], [o for _, o in items]
    forward, backward = mcnemar(full, other), mcnemar(other, full)
    assert (forward.only_full, forward.only_other) == (backward.only_other, backward.only_full)
    assert forward.p_value == backward.p_value


def test_mcnemar_stays_finite_for_thousands_of_discordant_items():
    result = mcnemar(*_scorings(2000, 2600))
    assert 0.0 < result.p_value < 1e-15
    assert result.p_value == pytest.approx(_binomial_tail_reference(2000, 2600), rel=1e-6)


# coarse KL


@given(logits, st.integers(1, 30))
def test_coarse_kl_of_equal_maps_is_zero(values, k):
    known = _top(_log_softmax(values), k)
    assert coarse_kl(known, dict(known)) == pytest.approx(0.0, abs=1e-12)


@given(st.data())
def test_coarse_kl_over_the_whole_vocabulary_is_the_exact_kl(data):
    log_p, log_q = _two_distributions(data)
    exact = _exact_kl(log_p, log_q)
    assert coarse_kl(dict(enumerate(log_p)), dict(enumerate(log_q))) == pytest.approx(
        exact, rel=1e-9, abs=1e-9
    )


@given(st.data())
def test_coarse_kl_of_top_k_maps_is_at_most_the_exact_kl(data):
    log_p, log_q = _two_distributions(data)
    n = len(log_p)
    p = _top(log_p, data.draw(st.integers(1, n)))
    q = _top(log_q, data.draw(st.integers(1, n)))
    extra = data.draw(st.integers(0, n - 1))  # the sampled token, as an engine adds it
    p[extra], q[extra] = log_p[extra], log_q[extra]
    assert 0.0 <= coarse_kl(p, q) <= _exact_kl(log_p, log_q) + 1e-9


def test_coarse_kl_matches_a_hand_computed_coarse_graining():
    # P = (0.5, 0.5) whole; Q knows only token 0 at 0.9: buckets {0} and the rest.
    p = {0: math.log(0.5), 1: math.log(0.5)}
    q = {0: math.log(0.9)}
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert coarse_kl(p, q) == pytest.approx(expected, rel=1e-12)


def test_coarse_kl_of_disjoint_maps_is_zero():
    assert coarse_kl({0: math.log(0.9)}, {1: math.log(0.9)}) == 0.0


def test_coarse_kl_treats_a_known_mass_that_rounds_above_one_as_no_remainder():
    p = {0: math.log(0.6), 1: math.log(0.4) + 1e-9}
    q = {0: math.log(0.5), 1: math.log(0.5) + 1e-9}
    expected = 0.6 * math.log(0.6 / 0.5) + 0.4 * math.log(0.4 / 0.5)
    assert coarse_kl(p, q) == pytest.approx(expected, rel=1e-6)


def test_coarse_kl_refuses_logits():
    with pytest.raises(ValueError, match="logits"):
        coarse_kl({0: 3.2, 1: 1.0}, {0: -0.1})


# margins


def test_margin_is_the_gap_between_the_top_two_known_tokens():
    assert margin({5: -3.0, 1: -0.1, 9: -1.0}) == pytest.approx(0.9)


def test_margin_of_a_single_known_token_is_infinite():
    assert margin({3: -0.2}) == math.inf


def test_margin_of_no_known_token_is_refused():
    with pytest.raises(ValueError, match="no token"):
        margin({})


@pytest.mark.parametrize(
    ("m", "name"),
    [
        (0.0, "low"),
        (0.4999, "low"),
        (0.5, "mid"),
        (1.9999, "mid"),
        (2.0, "high"),
        (math.inf, "high"),
        (None, "unknown"),
    ],
)
def test_margin_bin_edges(m, name):
    assert margin_bin(m) == name
    assert name in MARGIN_BINS


@pytest.mark.parametrize("m", [-0.1, math.nan])
def test_a_margin_that_is_not_a_gap_is_refused(m):
    with pytest.raises(ValueError, match="gap"):
        margin_bin(m)


def test_agreement_by_margin_splits_items_by_bin_then_all():
    agree = [True, False, True, True, False]
    margins = [0.1, 0.2, 3.0, None, 5.0]
    assert agreement_by_margin(agree, margins) == {
        "low": {"items": 2, "agreement": 0.5},
        "high": {"items": 2, "agreement": 0.5},
        "unknown": {"items": 1, "agreement": 1.0},
        "all": {"items": 5, "agreement": 0.6},
    }
    assert list(agreement_by_margin(agree, margins)) == ["low", "high", "unknown", "all"]


def test_agreement_by_margin_refuses_mismatched_or_empty_lists():
    with pytest.raises(ValueError, match="margins"):
        agreement_by_margin([True], [0.1, 0.2])
    with pytest.raises(ValueError, match="no items"):
        agreement_by_margin([], [])
