"""KMesh's layerwise executor on vLLM's loaded model: the same weights, no second copy.

On CPU vLLM keeps no plain weight in its linear layers (vllm/model_executor/layers/utils.py::
dispatch_cpu_unquantized_gemm prepacks each one for oneDNN and leaves `weight` empty), but the
layers stay callable. So the executor's projections call vLLM's own modules (`qkv_proj` with its
bias, `o_proj`, the MLP's `gate_up_proj`, activation and `down_proj`), while attention, RoPE and
the norms are KMesh's (the norm weights and the embedding are plain tensors in vLLM too). With
LoRA enabled vLLM wraps those modules; the bridge uses the base layers under the wrappers
(recovery serves base-model requests only).

Every family of kmesh.compute.config.FAMILIES loads into vLLM modules of the same shape (Llama's,
which Mistral's, Qwen 2's and Qwen 3's reuse or copy, and Gemma 3's): `model.embed_tokens`,
`model.layers[i]` with `self_attn` (`qkv_proj`, `o_proj`, `attn`, `rotary_emb`) and `mlp`, and
`model.norm`. What differs is read from the model's description, never from vLLM's class names:
with `qk_norm` the attention's `q_norm` / `k_norm`; with `sandwich_norms` (Gemma) the layer's
`post_attention_layernorm` is the norm on attention's output and `pre_feedforward_layernorm` the
pre-MLP norm (Llama's `post_attention_layernorm` is its pre-MLP norm), plus
`post_feedforward_layernorm` after the MLP.

Before the executor is built, kmesh/vllm/model_check.py checks the description against what vLLM
loaded (layers, heads, windows, scales, norms, biases, activation, RoPE tables, embedding scale,
soft-cap) and refuses a mismatch at start, in one line: the executor must compute what vLLM
computes.

The executor runs in the dtype of vLLM's embedding (the engine's dtype, float32 or bfloat16) and
keeps vLLM's tensors as they are: nothing is converted or copied.
"""

from typing import Any

import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.executor import Executor
from kmesh.compute.weights import ModelWeights
from kmesh.vllm.model_check import base_layer, check_vllm_model


class VllmLayer:
    """A vLLM decoder layer seen through kmesh.compute.weights.Layer."""

    def __init__(self, layer: Any, config: ModelConfig) -> None:
        attention = layer.self_attn
        self._qkv = base_layer(attention.qkv_proj)
        self._o = base_layer(attention.o_proj)
        self._gate_up = base_layer(layer.mlp.gate_up_proj)
        self._act = layer.mlp.act_fn  # the activation and product over the fused [gate, up]
        self._down = base_layer(layer.mlp.down_proj)
        self._sizes = [
            config.num_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
        ]
        self.input_norm: torch.Tensor = layer.input_layernorm.weight.data
        self.post_attention_norm: torch.Tensor | None = None
        self.post_mlp_norm: torch.Tensor | None = None
        if config.sandwich_norms:
            self.post_attention_norm = layer.post_attention_layernorm.weight.data
            self.pre_mlp_norm: torch.Tensor = layer.pre_feedforward_layernorm.weight.data
            self.post_mlp_norm = layer.post_feedforward_layernorm.weight.data
        else:
            self.pre_mlp_norm = layer.post_attention_layernorm.weight.data
        self.q_norm: torch.Tensor | None = None
        self.k_norm: torch.Tensor | None = None
        if config.qk_norm:
            self.q_norm = attention.q_norm.weight.data
            self.k_norm = attention.k_norm.weight.data

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self._qkv(h)[0].split(self._sizes, dim=-1)
        return q, k, v  # views of the fused output (the executor views them per head)

    def o(self, attn: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._o(attn)[0]
        return out

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._down(self._act(self._gate_up(h)[0]))[0]
        return out


def executor_of_vllm_model(model: Any, config: ModelConfig) -> Executor:
    """An executor over a vLLM model module (`model_runner.model`) of any family KMesh runs;
    ModelNotSupportedError where vLLM's model is not the one `config` describes."""
    check_vllm_model(model, config)
    inner = model.model
    embed = inner.embed_tokens.weight.data[: config.vocab_size]
    lm_head = embed if config.tie_word_embeddings else model.lm_head.weight.data
    weights = ModelWeights(
        embed_tokens=embed,
        layers=tuple(VllmLayer(layer, config) for layer in inner.layers),
        final_norm=inner.norm.weight.data,
        lm_head=lm_head[: config.vocab_size],
    )
    return Executor(config, weights)
