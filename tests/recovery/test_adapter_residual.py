"""Base + low-rank residual: exact where it must be, gated, and its bytes as stated."""

import torch

from kmesh.compute.executor import SequenceInput
from kmesh.compute.lora import LoraUse
from kmesh.recovery.adapter_residual import (
    ResidualConfig,
    adapter_context,
    approximate_kv,
    compute_base,
)
from tests.conftest import random_tokens
from tests.random_lora import random_adapter

CONTEXT = random_tokens(40, seed=3)


def _exact(executor, adapter):
    tokens = torch.tensor(CONTEXT)
    [out] = executor.forward(
        [SequenceInput(tokens, torch.arange(len(tokens)), lora=LoraUse(adapter, 0))]
    )
    return out


def test_the_approximation_is_exact_in_the_first_layer_and_not_after(tiny):
    executor, _ = tiny
    adapter = random_adapter(executor.config, seed=1)
    base = compute_base(executor, CONTEXT, [adapter])
    approx = approximate_kv(executor, base, adapter)
    exact = _exact(executor, adapter)
    torch.testing.assert_close(approx.k[0], exact.k[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(approx.v[0], exact.v[0], rtol=0, atol=1e-5)
    assert (approx.v[1] - exact.v[1]).abs().max() > 1e-3  # hidden states drift after layer 0


def test_an_adapter_keeps_rank_numbers_per_token_layer_and_projection(tiny):
    executor, _ = tiny
    adapters = [random_adapter(executor.config, seed=s, rank=4) for s in (1, 2)]
    base = compute_base(executor, CONTEXT, adapters)
    for adapter in adapters:
        residual = base.residuals[adapter.key]
        assert residual.nbytes == executor.config.num_layers * 2 * len(CONTEXT) * 4 * 4


def test_the_gate_accepts_a_close_approximation_and_keeps_the_recomputed_check_rows(tiny):
    executor, _ = tiny
    adapter = random_adapter(executor.config, seed=1, scale=0.05)
    base = compute_base(executor, CONTEXT, [adapter])
    outcome = adapter_context(executor, base, adapter, ResidualConfig(8, 0.5))
    assert outcome.kv is not None and outcome.computed_tokens == 8
    assert 0 < outcome.deviation < 0.5
    approx = approximate_kv(executor, base, adapter)
    last = executor.config.num_layers - 1
    assert torch.equal(outcome.kv.k[last][:32], approx.k[last][:32])
    assert not torch.equal(outcome.kv.k[last][32:], approx.k[last][32:])


def test_the_default_gate_refuses_an_adapter_that_moves_the_context_far(tiny):
    executor, _ = tiny
    adapter = random_adapter(executor.config, seed=1, scale=2.0)
    base = compute_base(executor, CONTEXT, [adapter])
    outcome = adapter_context(executor, base, adapter, ResidualConfig())
    assert outcome.kv is None and outcome.deviation > ResidualConfig().max_deviation
