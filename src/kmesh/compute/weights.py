"""Llama weights gathered from a Hugging Face style state dict."""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kmesh.compute.config import ModelConfig
from kmesh.errors import ModelNotFoundError


@dataclass(frozen=True, slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    post_attention_norm: torch.Tensor
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor


@dataclass(frozen=True, slots=True)
class LlamaWeights:
    embed_tokens: torch.Tensor
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor
    # The output projection; the embedding itself when the model ties them.
    lm_head: torch.Tensor

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, torch.Tensor], config: ModelConfig, dtype: torch.dtype
    ) -> "LlamaWeights":
        def get(name: str) -> torch.Tensor:
            if name not in state:
                raise ModelNotFoundError(f"weight {name!r} is missing from the model's files")
            return state[name].to(dtype)

        layers = tuple(
            LayerWeights(
                input_norm=get(f"model.layers.{i}.input_layernorm.weight"),
                q_proj=get(f"model.layers.{i}.self_attn.q_proj.weight"),
                k_proj=get(f"model.layers.{i}.self_attn.k_proj.weight"),
                v_proj=get(f"model.layers.{i}.self_attn.v_proj.weight"),
                o_proj=get(f"model.layers.{i}.self_attn.o_proj.weight"),
                post_attention_norm=get(f"model.layers.{i}.post_attention_layernorm.weight"),
                gate_proj=get(f"model.layers.{i}.mlp.gate_proj.weight"),
                up_proj=get(f"model.layers.{i}.mlp.up_proj.weight"),
                down_proj=get(f"model.layers.{i}.mlp.down_proj.weight"),
            )
            for i in range(config.num_layers)
        )
        embed = get("model.embed_tokens.weight")
        lm_head = embed if config.tie_word_embeddings else get("lm_head.weight")
        return cls(embed, layers, get("model.norm.weight"), lm_head)
