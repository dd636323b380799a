"""KMesh's layerwise executor on vLLM's loaded model: the same weights, no second copy.

On CPU vLLM keeps no plain weight in its linear layers (vllm/model_executor/layers/utils.py::
dispatch_cpu_unquantized_gemm prepacks each one for oneDNN and leaves `weight` empty), but the
layers stay callable. So the executor's projections call vLLM's own modules (`qkv_proj`, `o_proj`,
the MLP's `gate_up_proj`, activation and `down_proj`), while attention, RoPE and the norms are
KMesh's (the norm weights and the embedding are plain tensors in vLLM too). With LoRA enabled vLLM
wraps those modules; the bridge uses the base layers under the wrappers (recovery serves
base-model requests only).

The executor runs in the dtype of vLLM's embedding (the engine's dtype, float32 or bfloat16) and
keeps vLLM's tensors as they are: nothing is converted or copied.
"""

from typing import Any

import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.executor import Executor
from kmesh.compute.weights import ModelWeights


class VllmLayer:
    """A vLLM LlamaDecoderLayer seen through kmesh.compute.weights.Layer."""

    def __init__(self, layer: Any, config: ModelConfig) -> None:
        attention = layer.self_attn
        self._qkv = _base(attention.qkv_proj)
        self._o = _base(attention.o_proj)
        self._gate_up = _base(layer.mlp.gate_up_proj)
        self._act = layer.mlp.act_fn  # SiluAndMul over the fused [gate, up] output
        self._down = _base(layer.mlp.down_proj)
        self._sizes = [
            config.num_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
        ]
        self.input_norm: torch.Tensor = layer.input_layernorm.weight.data
        self.post_attention_norm: torch.Tensor = layer.post_attention_layernorm.weight.data

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
    """An executor over a vLLM Llama-family model module (`model_runner.model`)."""
    inner = model.model
    if len(inner.layers) != config.num_layers:
        raise ValueError(
            f"vLLM's model has {len(inner.layers)} layers, the model folder's config "
            f"{config.num_layers}: not the same model"
        )
    embed = inner.embed_tokens.weight.data[: config.vocab_size]
    lm_head = embed if config.tie_word_embeddings else model.lm_head.weight.data
    weights = ModelWeights(
        embed_tokens=embed,
        layers=tuple(VllmLayer(layer, config) for layer in inner.layers),
        final_norm=inner.norm.weight.data,
        lm_head=lm_head[: config.vocab_size],
    )
    return Executor(config, weights)


def _base(module: Any) -> Any:
    """The layer under a vLLM LoRA wrapper (the module itself without LoRA)."""
    return getattr(module, "base_layer", module)
