"""The model description (kmesh/compute/config.py): what each family's config becomes, the
refusals, and re-rotation per layer's RoPE table on every family."""

import json

import pytest
import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.executor import SequenceInput
from kmesh.compute.loader import load_model
from kmesh.compute.rope import rerotate_keys
from kmesh.compute.support import require, support
from kmesh.compute.tiny import TINY_HF_CONFIG
from kmesh.errors import ModelNotSupportedError
from tests.model_families import FAMILIES


def described(name: str) -> ModelConfig:
    return ModelConfig.from_hf(FAMILIES[name].to_dict())


def test_each_family_becomes_explicit_fields():
    llama2, qwen2, qwen3 = described("llama2"), described("qwen2"), described("qwen3")
    gemma, mistral = described("gemma3"), described("mistral")
    assert (qwen2.qkv_bias, qwen2.o_bias) == (True, False)  # Qwen 2's implicit qkv bias
    assert qwen3.qk_norm and not qwen3.sandwich_norms and qwen3.norm == "llama"
    assert not llama2.qk_norm and llama2.embedding_scale is None and not llama2.windowed
    assert gemma.norm == "gemma" and gemma.sandwich_norms and gemma.qk_norm
    assert gemma.embedding_scale == pytest.approx(gemma.hidden_size**0.5)
    scalar = FAMILIES["gemma3"].query_pre_attn_scalar
    assert scalar != gemma.head_dim and gemma.attention_scale == pytest.approx(scalar**-0.5)
    assert gemma.activation == "gelu_tanh" and mistral.activation == "silu"
    # Gemma: windows where layer_types says sliding, and one RoPE table per layer type.
    types = FAMILIES["gemma3"].layer_types
    assert [w is not None for w in gemma.windows] == [t == "sliding_attention" for t in types]
    local, global_ = (
        gemma.layers[types.index(kind)].rope for kind in [*types[:1], "full_attention"]
    )
    assert (local.theta, global_.theta) == (10000.0, 1000000.0)
    assert len(gemma.rope_tables) == 2
    assert all(w == FAMILIES["mistral"].sliding_window for w in mistral.windows)


def test_scalings_change_the_frequencies_and_yarn_its_magnitude():
    plain = described("llama2").layers[0].rope
    for name in ("llama3", "llama_linear", "qwen2_yarn"):
        table = described(name).layers[0].rope
        assert table.scaling != "default"
        assert table.inv_freq != plain.inv_freq or table.theta != plain.theta
    assert described("qwen2_yarn").layers[0].rope.attention_factor > 1.0
    assert described("llama3").layers[0].rope.attention_factor == 1.0


def test_old_style_configs_are_normalized():
    """Hub checkpoints' config.json keep `rope_theta`/`rope_scaling` and Gemma's
    `rope_local_base_freq`; transformers normalizes them first."""
    old = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "sliding_window": 512,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
    }
    config = ModelConfig.from_hf(old)
    assert config.windows == (512,) * 5 + (None,)
    assert [layer.rope.theta for layer in config.layers] == [10000.0] * 5 + [1000000.0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"model_type": "mixtral", "num_local_experts": 8}, "mixture-of-experts"),
        ({"model_type": "deepseek_v3", "kv_lora_rank": 512}, "multi-head latent attention"),
        ({"model_type": "gemma3", "text_config": {}, "vision_config": {}}, "multimodal"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic'"),
        ({"rope_scaling": {"rope_type": "longrope"}}, "RoPE scaling 'longrope'"),
        ({"partial_rotary_factor": 0.5}, "partial rotary"),
        ({"attn_logit_softcapping": 50.0}, "soft-caps attention"),
        ({"hidden_act": "relu"}, "activation 'relu'"),
    ],
)
def test_what_is_not_supported_is_refused_in_one_line(change, message):
    with pytest.raises(ModelNotSupportedError, match=message) as refused:
        ModelConfig.from_hf({**TINY_HF_CONFIG, **change})
    assert "\n" not in str(refused.value)


def test_vllm_is_refused_where_every_layer_is_windowed():
    assert support(described("mistral"), "KMeshConnector in vLLM").status == "refused"
    assert support(described("gemma3"), "KMeshConnector in vLLM").label == "exact, tested"


def test_the_adapter_residual_is_refused_under_qk_norm():
    assert support(described("qwen3"), "adapter residual").status == "refused"
    with pytest.raises(ModelNotSupportedError, match="QK-norm"):
        require(described("gemma3"), "adapter residual")
    require(described("qwen2"), "adapter residual")  # no QK-norm: allowed


@pytest.mark.parametrize("name", list(FAMILIES))
def test_keys_rerotated_to_another_offset_equal_keys_computed_there(family_folder, name):
    """The whole prompt shifted by d: attention sees the same relative positions, so every
    layer's keys computed at the new offset are the old ones turned by d with that layer's own
    table (YaRN's magnitude is in both). Float32 throughout: the turn and the recomputation
    round differently, ~1e-6 relative; bound 1e-4 of the keys' scale."""
    executor = load_model(family_folder(name)).executor
    tokens = torch.randint(
        3, executor.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)
    )

    def keys_at(offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(offset, offset + len(tokens))
        return torch.stack(executor.forward([SequenceInput(tokens, positions)])[0].k), positions

    k_p, at_p = keys_at(3)
    k_q, at_q = keys_at(700)
    moved = rerotate_keys(k_p, at_p, at_q, executor.config)
    scale = k_q.abs().max()
    assert ((moved - k_q).abs().max() / scale) < 1e-4
    assert ((k_p - k_q).abs().max() / scale) > 1e-2  # the turn is not a no-op


def test_a_saved_config_round_trips(family_folder):
    folder = family_folder("gemma3")
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    assert config == described("gemma3")
