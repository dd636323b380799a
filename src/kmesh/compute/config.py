"""A model's description, read from its Hugging Face config: everything KMesh's computations
need to know about a decoder-only model, per layer where it varies.

Families KMesh runs (the `model_type` values of `FAMILIES`) are told apart here and only here:
what a family's config leaves implicit (Qwen 2's qkv bias, Gemma's norms and scales) becomes an
explicit field, and everything else reads the fields. A config is first normalized by
transformers (`AutoConfig.for_model`: old-style `rope_theta`/`rope_scaling`/`rope_local_base_freq`
become `rope_parameters`, Qwen's `use_sliding_window` becomes `layer_types`); whatever the
description cannot express is refused here in one line (`ModelNotSupportedError`), never run
approximately.

Fields, for a newcomer:
- `layers[i].window`: a sliding window W (query at p sees keys at p - W + 1 .. p; Hugging Face's
  and vLLM's convention) or None (global attention); `layers[i].rope`: that layer's RoPE table.
- `RopeTable.inv_freq`: the rotation's frequencies after scaling (linear, llama3, YaRN change
  them); `attention_factor` multiplies cos and sin in the forward (YaRN's magnitude, 1 otherwise)
  and is not part of the rotation, so re-rotating a stored key uses the pure rotation.
- `norm`: "llama" (`w * normalize(x)` rounded to the dtype before the product, Llama's RMSNorm)
  or "gemma" (`(1 + w) * normalize(x)` in float32, rounded after); `sandwich_norms`: a norm after
  attention and after the MLP too (Gemma 2/3), before each residual add.
- `qk_norm`: an RMSNorm over each head's query and key, before RoPE (Qwen 3, Gemma 3).
- `embedding_scale`: the embedding's multiplier (Gemma: sqrt(hidden)); `attention_scale`: the
  scores' multiplier (1/sqrt(head_dim), or Gemma's 1/sqrt(query_pre_attn_scalar)).
"""

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kmesh.errors import ModelNotSupportedError

if TYPE_CHECKING:
    import torch

# The dtypes KMesh computes a model in, on either engine (recovery runs in both), and their bytes.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
DTYPES = tuple(DTYPE_BYTES)
# RoPE scalings implemented: each is a fixed set of frequencies (and YaRN a fixed magnitude).
# `dynamic` and `longrope` change with the sequence's length, so a key computed at one length
# would not be the key at another: refused.
ROPE_SCALINGS = ("default", "linear", "llama3", "yarn")
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True, slots=True)
class RopeTable:
    scaling: str  # one of ROPE_SCALINGS
    theta: float
    # head_dim / 2 frequencies (float32 values), scaling applied
    inv_freq: tuple[float, ...] = field(repr=False)
    attention_factor: float  # multiplies cos and sin in the forward (YaRN); 1.0 otherwise


@dataclass(frozen=True, slots=True)
class LayerSpec:
    window: int | None  # sliding window W, or None: global attention
    rope: RopeTable


@dataclass(frozen=True, slots=True)
class _Family:
    """What a family's config leaves implicit. A bias given as None is the config's
    `attention_bias`."""

    qkv_bias: bool | None
    o_bias: bool | None
    qk_norm: bool
    gemma: bool  # (1 + w) norms, sandwich norms, sqrt(hidden) embedding, query_pre_attn_scalar
    window_everywhere: bool  # `sliding_window` applies to every layer (no `layer_types`)


FAMILIES = {
    "llama": _Family(None, None, qk_norm=False, gemma=False, window_everywhere=False),
    "mistral": _Family(False, False, qk_norm=False, gemma=False, window_everywhere=True),
    "qwen2": _Family(True, False, qk_norm=False, gemma=False, window_everywhere=False),
    "qwen3": _Family(None, None, qk_norm=True, gemma=False, window_everywhere=False),
    "gemma3_text": _Family(None, None, qk_norm=True, gemma=True, window_everywhere=False),
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    family: str  # the config's model_type, one of FAMILIES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    layers: tuple[LayerSpec, ...]
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    norm: Literal["llama", "gemma"]
    sandwich_norms: bool
    embedding_scale: float | None
    attention_scale: float
    activation: Literal["silu", "gelu_tanh"]
    final_softcap: float | None

    def kv_bytes_per_token(self, dtype: str) -> int:
        """One token's K and V over every layer, in `dtype` (one of DTYPES)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: global)."""
        return tuple(layer.window for layer in self.layers)

    @property
    def windowed(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return any(w is not None for w in self.windows)

    @property
    def rope_tables(self) -> tuple[RopeTable, ...]:
        """The distinct RoPE tables, in the order layers first use them."""
        return tuple(dict.fromkeys(layer.rope for layer in self.layers))

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        """Describe the model of a folder's config.json (`from_hf`)."""
        return cls.from_hf(json.loads((Path(folder) / "config.json").read_text()))

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Describe the model of a Hugging Face config (config.json as a dict), or raise
        ModelNotSupportedError saying what is not supported and why."""
        model_type = hf.get("model_type")
        _refuse_unsupported(hf)
        family = FAMILIES.get(str(model_type))
        if family is None:
            raise ModelNotSupportedError(
                f"model_type {model_type!r} is not supported: KMesh runs "
                f"{', '.join(FAMILIES)} decoders (Llama 2/3, Mistral, Qwen 2/2.5/3, Gemma 3)"
            )
        from transformers import AutoConfig

        try:
            config = AutoConfig.for_model(**hf)
        except (KeyError, TypeError, ValueError) as error:
            raise ModelNotSupportedError(
                f"the {model_type!r} config is not one transformers accepts: {error}"
            ) from None
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise ModelNotSupportedError(
                f"activation {act!r} is not supported; KMesh runs {', '.join(_ACTIVATIONS)}"
            )
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        scalar = getattr(config, "query_pre_attn_scalar", None) if family.gemma else None
        return cls(
            family=str(model_type),
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            max_position=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            layers=_layers(config, family, head_dim),
            qkv_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
            o_bias=attention_bias if family.o_bias is None else family.o_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=family.qk_norm,
            norm="gemma" if family.gemma else "llama",
            sandwich_norms=family.gemma,
            embedding_scale=math.sqrt(config.hidden_size) if family.gemma else None,
            attention_scale=(scalar or head_dim) ** -0.5,
            activation=_ACTIVATIONS[act],  # type: ignore[arg-type]
            final_softcap=getattr(config, "final_logit_softcapping", None),
        )


def _refuse_unsupported(hf: Mapping[str, Any]) -> None:
    """One line for each kind of model KMesh's description cannot express."""
    name = hf.get("model_type")
    if "vision_config" in hf or "text_config" in hf or "audio_config" in hf:
        raise ModelNotSupportedError(
            f"{name!r} is a multimodal wrapper: KMesh runs text-only decoders (use the text "
            "model's own folder, e.g. model_type 'gemma3_text' for Gemma 3)"
        )
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hf.get(key):
            raise ModelNotSupportedError(
                f"{name!r} is a mixture-of-experts model ({key}={hf[key]}): KMesh's executor runs "
                "dense MLPs only"
            )
    if hf.get("kv_lora_rank") or hf.get("q_lora_rank"):
        raise ModelNotSupportedError(
            f"{name!r} uses multi-head latent attention (MLA): KMesh's KV is per-head keys and "
            "values, which MLA does not store"
        )
    if hf.get("attn_logit_softcapping"):
        raise ModelNotSupportedError(
            f"{name!r} soft-caps attention scores (attn_logit_softcapping): KMesh's attention "
            "kernels do not, so its recomputation would not match the model's"
        )
    for params in _raw_rope_parameters(hf):
        _check_scaling(params)
    if hf.get("use_bidirectional_attention"):
        raise ModelNotSupportedError(
            f"{name!r} attends bidirectionally: KMesh runs causal decoders"
        )


def _raw_rope_parameters(hf: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The config's RoPE parameter sets as written (one, or one per layer type)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        return []
    nested = [value for value in params.values() if isinstance(value, Mapping)]
    return nested or [params]


def _check_scaling(params: Mapping[str, Any]) -> None:
    scaling = params.get("rope_type", params.get("type", "default"))
    if scaling not in ROPE_SCALINGS:
        raise ModelNotSupportedError(
            f"RoPE scaling {scaling!r} is not supported; KMesh implements "
            f"{', '.join(ROPE_SCALINGS)} (dynamic and longrope rotate a key differently as the "
            "sequence grows)"
        )


def _layers(config: Any, family: _Family, head_dim: int) -> tuple[LayerSpec, ...]:
    """Each layer's window and RoPE table, from `layer_types` (and per-type `rope_parameters`)
    where the config has them."""
    count = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        kind = "sliding_attention" if family.window_everywhere and window else "full_attention"
        types = [kind] * count
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ModelNotSupportedError(
            f"layer types {sorted(unknown)} are not supported; KMesh runs full and "
            "sliding-window attention layers"
        )
    params = config.rope_parameters
    per_type = isinstance(params, Mapping) and set(params) <= {
        "sliding_attention",
        "full_attention",
    }
    tables = {
        kind: _rope_table(config, params[kind] if per_type else params, kind if per_type else None)
        for kind in set(types)
    }
    return tuple(
        LayerSpec(window if kind == "sliding_attention" else None, tables[kind]) for kind in types
    )


def _rope_table(config: Any, params: Mapping[str, Any], layer_type: str | None) -> RopeTable:
    """One RoPE table: transformers' own frequency functions for the scalings it defines."""
    _check_scaling(params)
    scaling = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelNotSupportedError(
            "partial rotary embeddings (partial_rotary_factor < 1) are not supported yet"
        )
    theta = float(params["rope_theta"])
    if scaling == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq, factor = default_frequencies(dim, theta), 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling](config, "cpu", layer_type=layer_type)
    return RopeTable(scaling, theta, tuple(inv_freq.float().tolist()), float(factor))


def default_frequencies(head_dim: int, theta: float) -> "torch.Tensor":
    """Plain RoPE's frequencies theta^(-2i / head_dim), [head_dim / 2] float32."""
    import torch

    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)
