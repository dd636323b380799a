"""Query-aware scores against a brute-force computation (loops over rows and heads, in float64)
from a full forward of the same prompt, where the reused keys are the exact ones."""

from typing import Any

import pytest
import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.executor import Executor, SequenceInput
from kmesh.compute.tiny import TINY_HF_CONFIG, random_state_dict
from kmesh.compute.weights import ModelWeights
from kmesh.recovery.query_scores import QueryCapture, reusable_attention
from tests.conftest import random_tokens

ATOL = 1e-4  # as tests/recovery/test_recover.py: same fp32 math, another reduction order
T = 24


def _full(executor: Executor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A full forward of `tokens`: every token's normed input at layer 1, and keys there."""
    captured: dict[int, torch.Tensor] = {}
    out = executor.forward(
        [SequenceInput(tokens, torch.arange(len(tokens)))],
        on_layer_input=lambda i, h: captured.setdefault(i, h),
    )[0]
    return captured[1], out.k[1]


def _prompt(n: int) -> torch.Tensor:
    return torch.tensor(random_tokens(n, seed=11))


def _brute_force(
    executor: Executor,
    layer: int,
    h: torch.Tensor,
    positions: torch.Tensor,
    reusable: torch.Tensor,
    keys: torch.Tensor,
) -> torch.Tensor:
    window = executor.config.layers[layer].window
    q, _ = executor.queries_keys(layer, h[~reusable], positions[~reusable])
    heads, kv_heads = q.shape[1], keys.shape[1]
    scores = torch.zeros(len(positions), dtype=torch.float64)
    asking = 0
    for n, p in enumerate(positions[~reusable].tolist()):
        seen = [
            r
            for r in range(len(positions))
            if reusable[r] and positions[r] < p and (window is None or positions[r] > p - window)
        ]
        if not seen:
            continue
        asking += 1
        for head in range(heads):
            kv = head // (heads // kv_heads)
            logits = torch.stack([q[n, head].double() @ keys[r, kv].double() for r in seen])
            scores[seen] += torch.softmax(logits * executor.config.attention_scale, dim=0)
    return (scores / (asking * heads)).float()


class _Region:
    def __init__(self, reusable: torch.Tensor, start: int = 8) -> None:
        self.reusable = reusable
        self.positions = torch.arange(start, start + len(reusable))


@pytest.fixture(scope="module")
def windowed() -> Executor:
    """The tiny Llama with two sliding-window layers (a window of 8)."""
    hf: dict[str, Any] = {
        **TINY_HF_CONFIG,
        "layer_types": ["sliding_attention"] * 2,
        "sliding_window": 8,
    }
    config = ModelConfig.from_hf(hf)
    state = random_state_dict(0, hf, config.hidden_size**-0.5)
    return Executor(config, ModelWeights.from_state_dict(state, config, torch.float32))


@pytest.mark.parametrize("model", ["tiny", "windowed"])
def test_scores_equal_a_brute_force_computation_from_a_full_forward(tiny, windowed, model):
    executor = tiny[0] if model == "tiny" else windowed
    h, k = _full(executor, _prompt(8 + T))
    reusable = torch.ones(T, dtype=torch.bool)
    reusable[[0, 1, 12, 13, 20, 21, 22, 23]] = False  # new tokens before, among, after the rest
    region = _Region(reusable)
    scores = reusable_attention(executor, 1, h[8:][~reusable], region, k[8:])
    expected = _brute_force(executor, 1, h[8:], region.positions, reusable, k[8:])
    assert scores is not None
    torch.testing.assert_close(scores, expected, atol=1e-6, rtol=1e-5)
    assert bool((scores[~reusable] == 0).all())
    # every asking token's attention is a distribution over the reusable ones
    assert float(scores.sum()) == pytest.approx(1.0, abs=1e-5)


def test_scores_in_chunks_of_asking_tokens_equal_scores_at_once(tiny, monkeypatch):
    executor, _ = tiny
    h, k = _full(executor, _prompt(8 + T))
    reusable = torch.ones(T, dtype=torch.bool)
    reusable[-5:] = False
    region = _Region(reusable)
    at_once = reusable_attention(executor, 1, h[8:][~reusable], region, k[8:])
    # one asking token at a time: 4 heads x 19 keys each
    monkeypatch.setattr("kmesh.recovery.query_scores.SCORE_CHUNK_ELEMENTS", 4 * 19)
    chunked = reusable_attention(executor, 1, h[8:][~reusable], region, k[8:])
    assert at_once is not None and chunked is not None
    torch.testing.assert_close(chunked, at_once, atol=1e-6, rtol=1e-5)


def test_nothing_asks_when_every_new_token_precedes_the_reusable_ones(tiny):
    executor, _ = tiny
    h, k = _full(executor, _prompt(8 + T))
    reusable = torch.ones(T, dtype=torch.bool)
    reusable[:3] = False
    assert reusable_attention(executor, 1, h[8:11], _Region(reusable), k[8:]) is None
    everything = torch.ones(T, dtype=torch.bool)
    assert reusable_attention(executor, 1, h[:0], _Region(everything), k[8:]) is None


def test_the_capture_keeps_each_sequence_s_asking_rows_at_its_layer(tiny):
    executor, _ = tiny
    tokens = [torch.tensor(random_tokens(n, seed=n)) for n in (5, 7)]
    asking = [torch.tensor([0, 1, 0, 0, 1], dtype=torch.bool), torch.zeros(7, dtype=torch.bool)]
    asking[1][6] = True
    capture = QueryCapture(1, asking)
    executor.forward([SequenceInput(t, torch.arange(len(t))) for t in tokens], None, None, capture)
    for t, rows, kept in zip(tokens, asking, capture.inputs, strict=True):
        torch.testing.assert_close(kept, _full(executor, t)[0][rows], atol=ATOL, rtol=0)
