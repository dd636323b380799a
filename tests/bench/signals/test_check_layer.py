"""bench/signals/check_layer.py: the check-layer sweep on a tiny windowed model, its prompts, and
`kmesh bench signals --check-layers`'s refusals."""

import pytest
import torch

from kmesh.bench.signals.check_layer import deviations, measure_prompt, spearman
from kmesh.bench.signals.check_layer_prompts import make_prompt, random_prompt
from kmesh.compute.config import ModelConfig
from kmesh.compute.executor import Executor
from kmesh.compute.loader import load_tokenizer, resolve_model_dir
from kmesh.compute.tiny import TINY_HF_CONFIG, random_state_dict
from kmesh.compute.weights import ModelWeights
from kmesh.recovery.recover import RecoveryConfig, recover
from tests.cli.test_cli import kmesh_in_process

# The tiny Llama with 4 layers, the third global, the others windowed (8 tokens).
HF = {
    **TINY_HF_CONFIG,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
    "sliding_window": 8,
}


@pytest.fixture(scope="module")
def executor() -> Executor:
    config = ModelConfig.from_hf(HF)
    state = random_state_dict(0, HF, config.hidden_size**-0.5)
    return Executor(config, ModelWeights.from_state_dict(state, config, torch.float32))


def test_the_sweep_reads_at_each_layer_what_recovery_s_check_reads(executor):
    from kmesh.bench.signals.check_layer import _place

    prompt = random_prompt(256, seed=1, prefix=5, segments=(12, 20, 16))
    result = measure_prompt(executor, prompt, [1, 2], ratio=0.25)
    assert result["reused"] == 48 and result["segments"] == [12, 20, 16]
    assert result["tokens"] == 5 + 48 + 4 * 3
    assert result["deviation_by_layer"][0] == pytest.approx(0.0, abs=1e-5)  # layer 0 cannot
    region = _place(executor, prompt).region
    for layer in (1, 2):
        row = result["layers"][str(layer)]
        checked = recover(executor, [region], RecoveryConfig("kv_deviation", 0.25, layer))[0]
        assert checked.deviation == pytest.approx(row["deviation"], abs=1e-5)
        assert row["cost"] == pytest.approx(checked.computed_tokens, abs=0.01)
        assert -1.0 <= row["spearman"] <= 1.0
        assert row["kl"] >= 0.0 and row["kl_chosen_only"] >= 0.0
    assert "layer1_same_cost" not in result["layers"]["1"]
    same = result["layers"]["2"]["layer1_same_cost"]
    assert result["layers"]["2"]["cost"] > result["layers"]["1"]["cost"]
    assert result["layers"]["1"]["cost"] < 64 and 0.25 < same["ratio"] <= 1.0


def test_deviations_and_rank_correlation():
    full = torch.randn(3, 10, 2, 4)
    assert torch.equal(deviations(full, full), torch.zeros(3, 10))
    assert deviations(2 * full, full) == pytest.approx(torch.ones(3, 10))
    x = torch.randn(50)
    assert spearman(x, x.exp()) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)


def test_prompts_are_varied_text_of_the_lengths_asked_and_the_same_for_a_seed():
    tokenizer = load_tokenizer(resolve_model_dir(None))
    prompt = make_prompt(tokenizer, seed=3, segments=4, lengths=(150, 400))
    reused = [part for part, is_reused in prompt.parts if is_reused]
    assert len(reused) == 4 and all(150 <= len(part) <= 400 for part in reused)
    assert len({part[:20] for part in reused}) == 4
    assert prompt.own == ()  # the embedded model's tokenizer adds no BOS
    assert not prompt.parts[-1][1]  # the question is new
    assert make_prompt(tokenizer, seed=3, segments=4) == prompt
    assert make_prompt(tokenizer, seed=4, segments=4) != prompt


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--check-layers", "1", "--fit", "a.json"], "takes no --fit or --test"),
        (["--check-layers", "1", "--ratio", "1.5"], "--ratio must be in (0, 1)"),
        (["--check-layers", "1", "--lengths", "400,150"], "--lengths takes the shortest"),
        (["--check-layers", "1", "--segments", "0"], "--segments must be at least 1"),
        (["--fit", "a.json"], "give --fit and --test"),
    ],
)
def test_bad_sweep_flags_get_one_clear_line(args, message, capsys):
    status, stderr = kmesh_in_process(["bench", "signals", *args, "--json", "x.json"], capsys)
    assert status == 2 and message in stderr and "Traceback" not in stderr
