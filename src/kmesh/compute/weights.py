"""A decoder's weights gathered from a Hugging Face style state dict, for every family of
kmesh.compute.config.FAMILIES (their checkpoints share Llama's tensor names, plus Gemma's sandwich
norms and Qwen 3's / Gemma 3's QK-norms).

The executor reaches a layer's projections through `Layer` (qkv / o / mlp), not through its
tensors, so the same executor also runs on modules whose weights live elsewhere (vLLM's linear
layers, which on CPU keep their weights prepacked: kmesh/vllm/model_bridge.py). Biases, where the
model has them, belong to the projections.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kmesh.compute.config import ModelConfig
from kmesh.errors import ModelNotFoundError


class Layer(Protocol):
    """One decoder layer as the executor uses it: its norm weights and three projections.
    A norm the model does not have is None."""

    @property
    def input_norm(self) -> torch.Tensor: ...

    @property
    def pre_mlp_norm(self) -> torch.Tensor: ...

    @property
    def post_attention_norm(self) -> torch.Tensor | None:
        """The sandwich norm on attention's output (Gemma), None without one."""
        ...

    @property
    def post_mlp_norm(self) -> torch.Tensor | None: ...

    @property
    def q_norm(self) -> torch.Tensor | None:
        """QK-norm's weight over each query head's head_dim (None: no QK-norm)."""
        ...

    @property
    def k_norm(self) -> torch.Tensor | None: ...

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[n, hidden] -> q [n, heads * head_dim], k and v [n, kv_heads * head_dim]."""
        ...

    def o(self, attn: torch.Tensor) -> torch.Tensor: ...

    def mlp(self, h: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class Linear:
    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    pre_mlp_norm: torch.Tensor
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear
    activation: str  # "silu" or "gelu_tanh" (ModelConfig.activation)
    post_attention_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q_proj(h), self.k_proj(h), self.v_proj(h)

    def o(self, attn: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attn)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(activate(self.gate_proj(h), self.activation) * self.up_proj(h))


def activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The MLP's gate activation: SiLU, or GELU with the tanh approximation (Gemma)."""
    return F.silu(x) if activation == "silu" else F.gelu(x, approximate="tanh")


@dataclass(frozen=True, slots=True)
class ModelWeights:
    embed_tokens: torch.Tensor
    layers: Sequence[Layer]
    final_norm: torch.Tensor
    # The output projection; the embedding itself when the model ties them.
    lm_head: torch.Tensor

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, torch.Tensor], config: ModelConfig, dtype: torch.dtype
    ) -> "ModelWeights":
        def get(name: str) -> torch.Tensor:
            if name not in state:
                raise ModelNotFoundError(f"weight {name!r} is missing from the model's files")
            return state[name].to(dtype)

        def linear(name: str, bias: bool) -> Linear:
            return Linear(get(f"{name}.weight"), get(f"{name}.bias") if bias else None)

        def layer(i: int) -> LayerWeights:
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            sandwich = config.sandwich_norms
            return LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                q_proj=linear(attn + "q_proj", config.qkv_bias),
                k_proj=linear(attn + "k_proj", config.qkv_bias),
                v_proj=linear(attn + "v_proj", config.qkv_bias),
                o_proj=linear(attn + "o_proj", config.o_bias),
                # Gemma names its pre-MLP norm pre_feedforward_layernorm; its
                # post_attention_layernorm is the sandwich norm on attention's output.
                pre_mlp_norm=get(
                    p
                    + ("pre_feedforward_layernorm" if sandwich else "post_attention_layernorm")
                    + ".weight"
                ),
                gate_proj=linear(mlp + "gate_proj", config.mlp_bias),
                up_proj=linear(mlp + "up_proj", config.mlp_bias),
                down_proj=linear(mlp + "down_proj", config.mlp_bias),
                activation=config.activation,
                post_attention_norm=get(p + "post_attention_layernorm.weight")
                if sandwich
                else None,
                post_mlp_norm=get(p + "post_feedforward_layernorm.weight") if sandwich else None,
                q_norm=get(attn + "q_norm.weight") if config.qk_norm else None,
                k_norm=get(attn + "k_norm.weight") if config.qk_norm else None,
            )

        embed = get("model.embed_tokens.weight")
        lm_head = embed if config.tie_word_embeddings else get("lm_head.weight")
        layers = tuple(layer(i) for i in range(config.num_layers))
        return cls(embed, layers, get("model.norm.weight"), lm_head)
