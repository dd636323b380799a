"""Whether the model vLLM loaded is the one KMesh's description of its folder says
(kmesh/compute/config.py), checked once at start, before the executor is built on vLLM's modules
(kmesh/vllm/model_bridge.py).

KMesh's executor recomputes rows that vLLM then attends to as its own, so every difference between
the two would be silent: a layer vLLM runs with a sliding window and the description without one,
another attention scale, a (1 + w) norm read as w, a missing bias. Each check compares one field of
the description with the module vLLM built from the same config.json, and a mismatch raises
ModelNotSupportedError in one line, naming the layer and both values; vLLM then does not start.
Nothing here looks at vLLM's model class or the config's model_type: the description's fields say
which modules to expect.
"""

import math
from typing import Any, NoReturn

import torch

from kmesh.compute.config import ModelConfig, RopeTable
from kmesh.compute.rope import inverse_frequencies, rope_cos_sin
from kmesh.errors import ModelNotSupportedError

# Positions whose RoPE cos/sin are compared with vLLM's cos_sin_cache (its rows are rounded to
# the model's dtype): a wrong theta or scaling differs by far more than the tolerance there.
ROPE_POSITIONS = 512
ROPE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2}


def check_vllm_model(model: Any, config: ModelConfig) -> None:
    """Raise ModelNotSupportedError where vLLM's model (`model_runner.model`) differs from
    `config` in anything the executor relies on."""
    inner = model.model
    _require(
        len(inner.layers) == config.num_layers,
        f"vLLM's model has {len(inner.layers)} layers, the description {config.num_layers}",
    )
    rows = inner.embed_tokens.weight.shape[0]
    _require(
        rows >= config.vocab_size,
        f"vLLM's embedding has {rows} rows, the description's vocabulary {config.vocab_size}",
    )
    normalizer = getattr(inner, "normalizer", None)
    if config.embedding_scale is None:
        _require(normalizer is None, "vLLM scales the embedding, the description does not")
    else:
        want = torch.tensor(config.embedding_scale, dtype=inner.embed_tokens.weight.dtype)
        _require(
            normalizer is not None and float(normalizer) == float(want),
            f"vLLM's embedding scale is {None if normalizer is None else float(normalizer)}, "
            f"the description's {config.embedding_scale}",
        )
    processor = getattr(model, "logits_processor", None)
    cap = getattr(processor, "soft_cap", None)
    _require(
        cap == config.final_softcap,
        f"vLLM soft-caps logits at {cap}, the description at {config.final_softcap}",
    )
    for index, layer in enumerate(inner.layers):
        _check_layer(index, layer, config)


def base_layer(module: Any) -> Any:
    """The layer under a vLLM LoRA wrapper (the module itself without LoRA)."""
    return getattr(module, "base_layer", module)


def _check_layer(index: int, layer: Any, config: ModelConfig) -> None:
    where = f"layer {index}"
    attention = layer.self_attn
    attn = attention.attn
    for name, got, want in (
        ("query heads", attn.num_heads, config.num_heads),
        ("KV heads", attn.num_kv_heads, config.num_kv_heads),
        ("head size", attn.head_size, config.head_dim),
        ("sliding window", attn.sliding_window, config.layers[index].window),
    ):
        _require(got == want, f"{where}'s {name}: {got} in vLLM, {want} in the description")
    scale = getattr(attn.impl, "scale", None)
    scale = getattr(attention, "scaling", None) if scale is None else scale
    _require(
        scale is not None and math.isclose(scale, config.attention_scale, rel_tol=1e-6),
        f"{where}'s attention scale: {scale} in vLLM, {config.attention_scale} in the description",
    )
    for name, present, want in (
        ("QK-norm", hasattr(attention, "q_norm") and hasattr(attention, "k_norm"), config.qk_norm),
        (
            "sandwich norms",
            hasattr(layer, "pre_feedforward_layernorm")
            and hasattr(layer, "post_feedforward_layernorm"),
            config.sandwich_norms,
        ),
        ("qkv bias", base_layer(attention.qkv_proj).bias is not None, config.qkv_bias),
        ("o_proj bias", base_layer(attention.o_proj).bias is not None, config.o_bias),
        ("MLP bias", base_layer(layer.mlp.down_proj).bias is not None, config.mlp_bias),
    ):
        _require(
            present == want,
            f"{where}: vLLM's module {'has' if present else 'has no'} {name}, the description "
            f"{'has' if want else 'has none'}",
        )
    _check_norm(where, layer.input_layernorm, config)
    _check_activation(where, layer.mlp.act_fn, config)
    _check_rope(where, attention.rotary_emb, config.layers[index].rope, config)


def _check_norm(where: str, norm: Any, config: ModelConfig) -> None:
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    got = "gemma" if isinstance(norm, GemmaRMSNorm) else "llama"
    _require(
        got == config.norm,
        f"{where}'s norms are {got}-style in vLLM, {config.norm}-style in the description",
    )


def _check_activation(where: str, act: Any, config: ModelConfig) -> None:
    from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul

    if isinstance(act, SiluAndMul):
        got = "silu"
    elif isinstance(act, GeluAndMul) and act.approximate == "tanh":
        got = "gelu_tanh"
    else:
        got = type(act).__name__
    _require(
        got == config.activation,
        f"{where}'s MLP activation is {got} in vLLM, {config.activation} in the description",
    )


def _check_rope(where: str, rotary: Any, table: RopeTable, config: ModelConfig) -> None:
    cache: torch.Tensor | None = getattr(rotary, "cos_sin_cache", None)
    if (
        cache is None
        or getattr(rotary, "rotary_dim", None) != config.head_dim
        or not getattr(rotary, "is_neox_style", False)
    ):
        _refuse(
            f"{where}'s rotary embedding in vLLM is not a full-width rotate-half RoPE with a "
            "cos/sin table"
        )
    positions = torch.arange(min(ROPE_POSITIONS, cache.shape[0]))
    cos, sin = rope_cos_sin(positions, inverse_frequencies(table).to(cache.device))
    half = config.head_dim // 2
    want = torch.cat((cos[:, :half], sin[:, :half]), dim=-1) * table.attention_factor
    got = cache[positions.to(cache.device)].float()
    error = float((got - want).abs().max())
    tolerance = ROPE_TOLERANCE.get(cache.dtype, 2e-2)
    _require(
        error <= tolerance,
        f"{where}'s RoPE table differs from the description's ({table.scaling}, theta "
        f"{table.theta}) by {error:.3g} in cos/sin (tolerance {tolerance})",
    )


def _require(ok: bool, mismatch: str) -> None:
    if not ok:
        _refuse(mismatch)


def _refuse(mismatch: str) -> NoReturn:
    raise ModelNotSupportedError(
        f"vLLM's model does not match its config.json as KMesh reads it: {mismatch}; "
        "KMesh's executor would not compute what vLLM computes"
    )
