"""Quality metrics of an approximate prefill against the reference."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kmesh.bench.quality import Quality, greedy_decode, greedy_match, next_token_kl
from kmesh.compute.executor import DenseKV, SequenceInput
from kmesh.compute.lora import LoraUse
from tests.random_lora import random_adapter


def test_identical_logits_give_perfect_quality():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    greedy = [[1, 2, 3], [4, 5, 6], [7], [8, 9], [10] * 32]
    q = Quality.measure(logits, logits.clone(), greedy, [list(g) for g in greedy])
    assert 0.0 <= q.kl_mean <= 1e-12
    assert 0.0 <= q.kl_p95 <= 1e-12
    assert q.top1_agreement == 1.0
    assert q.greedy_match_32 == 1.0
    assert q.samples == 5


def test_two_token_kl_matches_the_hand_computed_value():
    p = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.9, 0.1]], dtype=torch.float64)
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    kl = next_token_kl(p.log(), q.log())
    assert kl.dtype == torch.float64
    assert kl.shape == (1,)
    assert kl.item() == pytest.approx(expected, abs=1e-12)


def test_kl_accepts_low_precision_logits_and_computes_in_float64():
    a = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    b = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    kl = next_token_kl(a.to(torch.bfloat16), b.to(torch.float16))
    assert kl.dtype == torch.float64
    assert torch.allclose(
        kl, next_token_kl(a.to(torch.bfloat16).double(), b.to(torch.float16).double())
    )


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 40))
def test_kl_is_non_negative_and_not_symmetric(seed, vocab):
    gen = torch.Generator().manual_seed(seed)
    a = 3 * torch.randn(4, vocab, generator=gen)
    b = 3 * torch.randn(4, vocab, generator=gen)
    forward = next_token_kl(a, b)
    backward = next_token_kl(b, a)
    assert (forward >= 0).all() and (backward >= 0).all()
    assert not torch.allclose(forward, backward, rtol=1e-6, atol=0.0)
    assert (next_token_kl(a, a) <= 1e-12).all()


def test_greedy_match_is_the_common_prefix_over_the_reference_length():
    assert greedy_match([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert greedy_match([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert greedy_match([1, 2, 3, 4], [5, 2, 3, 4]) == 0.0
    assert greedy_match([1, 2, 3, 4], [1, 2]) == 0.5
    assert greedy_match([1, 2], [1, 2, 3]) == 1.0
    with pytest.raises(ValueError, match="empty"):
        greedy_match([], [1])


def test_measure_aggregates_rows():
    # Rows 0 and 2 agree on the argmax, row 1 does not.
    reference = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0]])
    test = torch.tensor([[1.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    q = Quality.measure(reference, test, [[1, 2], [1, 2, 3, 4], [5]], [[1, 2], [1, 9, 3, 4], [6]])
    kl = next_token_kl(reference, test).numpy()
    assert q.kl_mean == pytest.approx(float(kl.mean()), abs=1e-15)
    assert q.kl_p95 == pytest.approx(float(np.percentile(kl, 95)), abs=1e-15)
    assert q.top1_agreement == pytest.approx(2 / 3)
    assert q.greedy_match_32 == pytest.approx((1.0 + 0.25 + 0.0) / 3)
    assert q.samples == 3


def test_p95_interpolates_like_numpy_percentile():
    # KL((1/2, 1/2) || softmax(0, x)) = ln cosh(x / 2), so x = 2 acosh(e^v) gives a row of KL v.
    values = [0.0, 0.1, 0.4, 0.2, 3.0, 0.05, 1.5]
    reference = torch.zeros(len(values), 2, dtype=torch.float64)
    test = torch.zeros_like(reference)
    test[:, 1] = 2 * torch.acosh(torch.tensor(values, dtype=torch.float64).exp())
    assert next_token_kl(reference, test).tolist() == pytest.approx(values, abs=1e-12)
    q = Quality.measure(reference, test, [[1]] * len(values), [[1]] * len(values))
    assert q.kl_p95 == pytest.approx(float(np.percentile(values, 95)), abs=1e-12)
    assert q.kl_mean == pytest.approx(float(np.mean(values)), abs=1e-12)


def test_as_dict_rounds():
    q = Quality(
        kl_mean=1.23456789e-5,
        kl_p95=0.000987654321,
        top1_agreement=2 / 3,
        greedy_match_32=0.123456,
        samples=3,
    )
    assert q.as_dict() == {
        "kl_mean": 1.23457e-5,
        "kl_p95": 0.000987654,
        "top1_agreement": 0.6667,
        "greedy_match_32": 0.1235,
        "samples": 3,
    }


@pytest.mark.parametrize(
    ("reference", "test", "ref_greedy", "greedy", "match"),
    [
        (torch.zeros(2, 5), torch.zeros(2, 6), [[1]] * 2, [[1]] * 2, "same shape"),
        (torch.zeros(2, 5), torch.zeros(3, 5), [[1]] * 2, [[1]] * 2, "same shape"),
        (torch.zeros(5), torch.zeros(5), [[1]], [[1]], "same shape"),
        (torch.zeros(0, 5), torch.zeros(0, 5), [], [], "n = 0"),
        (torch.zeros(2, 5), torch.zeros(2, 5), [[1]], [[1]] * 2, "greedy"),
        (torch.zeros(2, 5), torch.zeros(2, 5), [[1]] * 2, [[1]] * 3, "greedy"),
        (torch.zeros(2, 5), torch.zeros(2, 5), [[1], []], [[1], [1]], "empty"),
    ],
)
def test_measure_rejects_mismatched_inputs(reference, test, ref_greedy, greedy, match):
    with pytest.raises(ValueError, match=match):
        Quality.measure(reference, test, ref_greedy, greedy)


def test_kl_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="same shape"):
        next_token_kl(torch.zeros(2, 5), torch.zeros(2, 4))


def test_greedy_decode_matches_engine_style_decoding(tiny):
    executor, _ = tiny
    tokens = torch.tensor([5, 9, 17, 33, 2, 8])
    out = executor.forward([SequenceInput(tokens, torch.arange(6))])[0]
    context = DenseKV(torch.arange(6), out.k, out.v)
    got = greedy_decode(executor, [context], executor.logits(out.hidden[-1:]), 4)[0]
    ids = tokens.tolist()
    for _ in range(4):  # recompute the whole sequence for every token
        o = executor.forward([SequenceInput(torch.tensor(ids), torch.arange(len(ids)))])[0]
        ids.append(int(executor.logits(o.hidden[-1:]).argmax()))
    assert got == ids[6:]


def test_greedy_decode_under_an_adapter_matches_recomputing_under_it(tiny):
    executor, _ = tiny
    use = LoraUse(random_adapter(executor.config, seed=1), 0)
    tokens = torch.tensor([5, 9, 17, 33, 2, 8])
    out = executor.forward([SequenceInput(tokens, torch.arange(6), lora=use)])[0]
    context = DenseKV(torch.arange(6), out.k, out.v)
    got = greedy_decode(executor, [context], executor.logits(out.hidden[-1:]), 4, [use])[0]
    ids = tokens.tolist()
    for _ in range(4):
        o = executor.forward([SequenceInput(torch.tensor(ids), torch.arange(len(ids)), lora=use)])
        ids.append(int(executor.logits(o[0].hidden[-1:]).argmax()))
    assert got == ids[6:]
