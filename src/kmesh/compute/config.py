"""The shape of a Llama-family model, read from a Hugging Face config."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kmesh.errors import ModelNotFoundError

# The dtypes KMesh computes a model in, on either engine (recovery runs in both), and their bytes.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
DTYPES = tuple(DTYPE_BYTES)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def kv_bytes_per_token(self, dtype: str) -> int:
        """One token's K and V over every layer, in `dtype` (one of DTYPES)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face Llama config (config.json as a dict)."""
        if hf.get("model_type") != "llama":
            raise ModelNotFoundError(
                f"model_type {hf.get('model_type')!r} is not supported: KMesh's executor runs "
                "Llama-family models (model_type 'llama')"
            )
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelNotFoundError(
                f"RoPE type {rope_type!r} is not supported yet; only plain RoPE ('default')"
            )
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        num_heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rms_norm_eps=float(hf["rms_norm_eps"]),
            max_position=hf["max_position_embeddings"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
