"""LoRA in the executor, on the tiny model with random adapters (exactness against peft on the
embedded model with trained adapters: tests/compute/test_lora_real.py)."""

import json

import pytest
import torch

from kmesh.compute.executor import SequenceInput
from kmesh.compute.lora import LoraUse, load_adapter
from kmesh.errors import InvalidRequestError
from tests.conftest import random_tokens
from tests.random_lora import random_adapter

INVOCATION = (7, 8, 9)


def _run(executor, tokens, lora=None):
    t = torch.tensor(tokens)
    return executor.forward([SequenceInput(t, torch.arange(len(t)), lora=lora)])[0]


def test_an_adapter_changes_the_logits(tiny):
    executor, _ = tiny
    adapter = random_adapter(executor.config, seed=1)
    tokens = random_tokens(20, seed=0)
    base = executor.logits(_run(executor, tokens).hidden)
    adapted = executor.logits(_run(executor, tokens, LoraUse(adapter, 0)).hidden)
    assert (base - adapted).abs().max() > 0.1


def test_a_batch_of_several_adapters_equals_each_sequence_run_alone(tiny):
    executor, _ = tiny
    adapters = [random_adapter(executor.config, seed=s) for s in (1, 2)]
    prompts = [random_tokens(n, seed=n) for n in (9, 23, 14)]
    uses = [LoraUse(adapters[0], 0), None, LoraUse(adapters[1], 0)]
    batch = [
        SequenceInput(torch.tensor(p), torch.arange(len(p)), lora=use)
        for p, use in zip(prompts, uses, strict=True)
    ]
    together = executor.forward(batch)
    for prompt, use, out in zip(prompts, uses, together, strict=True):
        alone = _run(executor, prompt, use)
        torch.testing.assert_close(out.hidden, alone.hidden, rtol=0, atol=1e-5)


def test_an_activated_adapter_leaves_tokens_before_its_invocation_to_the_base_model(tiny):
    executor, _ = tiny
    adapter = random_adapter(executor.config, seed=3, invocation=INVOCATION)
    tokens = [*random_tokens(12, seed=4, low=10), *INVOCATION, *random_tokens(5, seed=5, low=10)]
    use = LoraUse.of(adapter, tokens)
    assert use is not None and use.start == 12
    base = _run(executor, tokens)
    adapted = _run(executor, tokens, use)
    for layer in range(executor.config.num_layers):
        assert torch.equal(adapted.k[layer][:12], base.k[layer][:12])
        assert torch.equal(adapted.v[layer][:12], base.v[layer][:12])
    assert (adapted.hidden[12:] - base.hidden[12:]).abs().max() > 0.01


def test_an_activated_adapter_starts_at_the_last_invocation_and_not_at_all_without_one(tiny):
    executor, _ = tiny
    adapter = random_adapter(executor.config, seed=3, invocation=INVOCATION)
    assert adapter.activation_start([1, *INVOCATION, 4, *INVOCATION, 5]) == 5
    assert adapter.activation_start([1, 7, 8, 4]) is None
    assert LoraUse.of(adapter, [1, 2, 3]) is None
    assert random_adapter(executor.config, seed=1).activation_start([1, 2]) == 0


def _write_peft_folder(path, config, tensors):
    from safetensors.torch import save_file

    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))


def test_an_adapter_on_the_mlp_is_refused_with_what_is_supported(tmp_path):
    prefix = "base_model.model.model.layers.0.mlp.up_proj"
    tensors = {
        f"{prefix}.lora_A.weight": torch.zeros(2, 4),
        f"{prefix}.lora_B.weight": torch.zeros(4, 2),
    }
    _write_peft_folder(tmp_path / "mlp", {"peft_type": "LORA", "r": 2, "lora_alpha": 2}, tensors)
    with pytest.raises(InvalidRequestError, match="q_proj, k_proj, v_proj, o_proj"):
        load_adapter(tmp_path / "mlp")


def test_a_dora_adapter_and_a_folder_without_an_adapter_are_refused(tmp_path):
    _write_peft_folder(
        tmp_path / "dora", {"peft_type": "LORA", "r": 2, "use_dora": True}, {"x": torch.zeros(1)}
    )
    with pytest.raises(InvalidRequestError, match="DoRA"):
        load_adapter(tmp_path / "dora")
    with pytest.raises(InvalidRequestError, match=r"adapter_config\.json"):
        load_adapter(tmp_path)
