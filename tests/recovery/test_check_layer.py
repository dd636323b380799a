"""The check layer's default: layer 1 on a model without sliding windows, the first global layer
on a windowed model; None resolves to it wherever a check layer flows (a
RecoveryConfig, a request's RecoverySpec, the All-Gather bench's config)."""

from typing import Any

import pytest
import torch

from kmesh.bench.allgather.config import AllGatherBenchConfig
from kmesh.compute.config import ModelConfig
from kmesh.compute.executor import DenseKV, Executor, SequenceInput
from kmesh.compute.tiny import SHAPES, TINY_HF_CONFIG, random_state_dict
from kmesh.compute.weights import ModelWeights
from kmesh.errors import InvalidRequestError
from kmesh.recovery.check_layer import check_layer_for, default_check_layer
from kmesh.recovery.recover import RecoveryConfig, RegionInput, recover
from kmesh.state.recovery_meta import RecoverySpec
from tests.conftest import random_tokens

S, F = "sliding_attention", "full_attention"


def _windowed(types: list[str], **fields: Any) -> dict[str, Any]:
    """The tiny Llama with these layer types (a window of 8)."""
    return {
        **TINY_HF_CONFIG,
        "num_hidden_layers": len(types),
        "layer_types": types,
        "sliding_window": 8,
        **fields,
    }


# Gemma 3 270M's layout: five local layers (window 512), then a global one, three times.
GEMMA3_270M = {
    "model_type": "gemma3_text",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": 512,
    "layer_types": ([S] * 5 + [F]) * 3,
    "rope_parameters": {
        S: {"rope_type": "default", "rope_theta": 10000.0},
        F: {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "max_position_embeddings": 32768,
    "bos_token_id": 2,
    "eos_token_id": 1,
}


@pytest.mark.parametrize(
    ("hf", "expected"),
    [
        (TINY_HF_CONFIG, 1),
        (SHAPES["smollm2_135m"], 1),  # the embedded model: 30 global layers
        (GEMMA3_270M, 5),
        (_windowed([S, S, F, S]), 2),
        (_windowed([F, S, S]), 1),  # the first layer global
        (_windowed([S, S, S]), 1),  # no global layer
        ({**TINY_HF_CONFIG, "model_type": "mistral", "sliding_window": 8}, 1),  # window everywhere
    ],
)
def test_the_default_check_layer_follows_the_model_s_first_global_layer(hf, expected):
    config = ModelConfig.from_hf(hf)
    assert default_check_layer(config) == expected
    assert check_layer_for(None, config) == expected


def test_a_given_check_layer_wins_and_is_checked_against_the_model():
    config = ModelConfig.from_hf(GEMMA3_270M)
    assert check_layer_for(1, config) == 1
    assert check_layer_for(17, config) == 17
    with pytest.raises(ValueError, match="not below the model's 18 layers"):
        check_layer_for(18, config)
    with pytest.raises(ValueError, match="must be >= 1"):
        check_layer_for(0, config)


@pytest.fixture(scope="module")
def windowed() -> Executor:
    """A tiny random Llama of 5 layers, the fourth global: its default check layer is 3."""
    hf = _windowed([S, S, S, F, S])
    config = ModelConfig.from_hf(hf)
    state = random_state_dict(0, hf, config.hidden_size**-0.5)
    return Executor(config, ModelWeights.from_state_dict(state, config, torch.float32))


def _garbage_region(executor: Executor, prefix: int = 6, n: int = 24) -> RegionInput:
    """The last n tokens after an exact prefix, all but the last 4 reusable with random KV."""
    tokens = torch.tensor(random_tokens(prefix + n, seed=5))
    out = executor.forward([SequenceInput(tokens, torch.arange(prefix + n))])[0]
    k, v = torch.stack(out.k), torch.stack(out.v)
    gen = torch.Generator().manual_seed(6)
    reusable = torch.ones(n, dtype=torch.bool)
    reusable[-4:] = False
    return RegionInput(
        tokens[prefix:],
        torch.arange(prefix, prefix + n),
        DenseKV(torch.arange(prefix), list(k[:, :prefix]), list(v[:, :prefix])),
        torch.randn(k[:, prefix:].shape, generator=gen),
        torch.randn(v[:, prefix:].shape, generator=gen),
        reusable,
        torch.zeros(n, dtype=torch.int64),
    )


def test_recovery_without_a_check_layer_checks_the_model_s_default(windowed):
    region = _garbage_region(windowed)
    default, third, first = (
        recover(windowed, [region], RecoveryConfig("kv_deviation", 0.25, check_layer=c))[0]
        for c in (None, 3, 1)
    )
    assert RecoveryConfig("kv_deviation", 0.25).check_layer is None
    assert default.deviation == third.deviation != first.deviation
    # every token through layers 0..3, the 5 chosen and the 4 new ones through the last
    assert default.computed_tokens == pytest.approx(24 * 4 / 5 + 9 * 1 / 5)
    assert torch.equal(default.recomputed, third.recomputed)
    torch.testing.assert_close(default.k, third.k, atol=0, rtol=0)
    with pytest.raises(ValueError, match="not below the model's 5 layers"):
        recover(windowed, [region], RecoveryConfig("kv_deviation", 0.25, check_layer=5))


def test_a_request_and_the_allgather_bench_leave_the_check_layer_to_the_model():
    assert RecoverySpec().check_layer is None
    assert RecoverySpec(check_layer=2).check_layer == 2
    with pytest.raises(ValueError):
        RecoverySpec(check_layer=0)
    bench = AllGatherBenchConfig()
    assert bench.check_layer is None
    gemma = ModelConfig.from_hf(GEMMA3_270M)
    assert bench.for_model(gemma).check_layer == 5
    assert bench.for_model(ModelConfig.from_hf(TINY_HF_CONFIG)).check_layer == 1
    assert AllGatherBenchConfig(check_layer=2).for_model(gemma).check_layer == 2
    with pytest.raises(InvalidRequestError, match="--check-layer: check layer 18"):
        AllGatherBenchConfig(check_layer=18).for_model(gemma)
    with pytest.raises(InvalidRequestError, match="--check-layer must be at least 1"):
        AllGatherBenchConfig(check_layer=0)
