"""bench/signals/recovery.py on the tiny random Llama: the last token's attention mass on reused
rows, and the probe that computes the last rows again."""

import pytest
import torch

from kmesh.bench.signals.recovery import PROBE_ROWS, attention_mass, probe
from kmesh.compute.config import ModelConfig
from kmesh.compute.executor import DenseKV, Executor, SequenceInput
from kmesh.compute.tiny import TINY_HF_CONFIG, random_state_dict
from kmesh.compute.weights import ModelWeights

N, FINAL = 60, 8  # prompt tokens, of which the final segment's


@pytest.fixture(scope="module")
def executor() -> Executor:
    config = ModelConfig.from_hf(TINY_HF_CONFIG)
    state = random_state_dict(0, TINY_HF_CONFIG, config.hidden_size**-0.5)
    return Executor(config, ModelWeights.from_state_dict(state, config, torch.float32))


@pytest.fixture(scope="module")
def prompt(executor):
    """Token ids, the prompt's exact KV [L, N, H, D] and its last token's logits."""
    tokens = torch.randint(
        3, executor.config.vocab_size, (N,), generator=torch.Generator().manual_seed(1)
    )
    out = executor.forward([SequenceInput(tokens, torch.arange(N))])[0]
    return tokens, torch.stack(out.k), torch.stack(out.v), executor.logits(out.hidden[-1:])[0]


def test_the_attention_mass_is_the_share_of_the_last_token_s_weights_on_the_rows_given(
    executor, prompt
):
    tokens, k, v, _ = prompt
    every, none = torch.ones(N, dtype=torch.bool), torch.zeros(N, dtype=torch.bool)
    first, rest = none.clone(), none.clone()
    first[:20], rest[20:] = True, True
    assert attention_mass(executor, tokens, k, v, every) == pytest.approx(1.0, abs=1e-5)
    assert attention_mass(executor, tokens, k, v, none) == 0.0
    split = attention_mass(executor, tokens, k, v, first) + attention_mass(
        executor, tokens, k, v, rest
    )
    assert split == pytest.approx(1.0, abs=1e-5)


def test_a_row_whose_key_matches_every_query_takes_the_attention(executor, prompt):
    tokens, k, v, _ = prompt
    one = torch.zeros(N, dtype=torch.bool)
    one[10] = True
    before = attention_mass(executor, tokens, k, v, one)
    loud = k.clone()
    loud[:, 10] *= 50.0  # a huge key: its scores dominate, whichever sign the query takes
    after = attention_mass(executor, tokens, loud, v, one)
    assert before < 0.5 and abs(after - before) > 0.05


def test_the_probe_of_an_exact_prompt_moves_nothing_and_of_a_disturbed_one_moves(executor, prompt):
    tokens, k, v, logits = prompt
    kl, shift = probe(executor, tokens, k, v, FINAL, logits)
    assert kl < 1e-9 and shift < 1e-6  # the same rows computed again: float rounding only
    disturbed_k, disturbed_v = k.clone(), v.clone()
    rows = slice(N - FINAL - PROBE_ROWS, N)
    generator = torch.Generator().manual_seed(2)
    disturbed_k[:, rows] += torch.randn(disturbed_k[:, rows].shape, generator=generator)
    disturbed_v[:, rows] += torch.randn(disturbed_v[:, rows].shape, generator=generator)
    # what a recovery that kept the disturbed rows says of the last token:
    kept = DenseKV(torch.arange(N - 1), list(disturbed_k[:, :-1]), list(disturbed_v[:, :-1]))
    out = executor.forward([SequenceInput(tokens[-1:], torch.tensor([N - 1]), kept)])[0]
    recovered = executor.logits(out.hidden)[0]
    kl, shift = probe(executor, tokens, disturbed_k, disturbed_v, FINAL, recovered)
    assert kl > 1e-4 and shift > 0  # the probe recomputed those rows: the exact state again
