"""Llama weights gathered from a Hugging Face style state dict.

The executor reaches a layer's projections through `Layer` (qkv / o / mlp), not through its
tensors, so the same executor also runs on modules whose weights live elsewhere (vLLM's linear
layers, which on CPU keep their weights prepacked: kmesh/vllm/model_bridge.py).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kmesh.compute.config import ModelConfig
from kmesh.errors import ModelNotFoundError


class Layer(Protocol):
    """One decoder layer as the executor uses it: its two norm weights and three projections."""

    @property
    def input_norm(self) -> torch.Tensor: ...

    @property
    def post_attention_norm(self) -> torch.Tensor: ...

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[n, hidden] -> q [n, heads * head_dim], k and v [n, kv_heads * head_dim]."""
        ...

    def o(self, attn: torch.Tensor) -> torch.Tensor: ...

    def mlp(self, h: torch.Tensor) -> torch.Tensor: ...


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

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return F.linear(h, self.q_proj), F.linear(h, self.k_proj), F.linear(h, self.v_proj)

    def o(self, attn: torch.Tensor) -> torch.Tensor:
        return F.linear(attn, self.o_proj)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(
            F.silu(F.linear(h, self.gate_proj)) * F.linear(h, self.up_proj), self.down_proj
        )


@dataclass(frozen=True, slots=True)
class LlamaWeights:
    embed_tokens: torch.Tensor
    layers: Sequence[Layer]
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
