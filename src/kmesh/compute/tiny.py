"""Random-weight Llamas where real weights do not matter: exactness tests (the tiny one by default)
and timings in a real model's shape (SHAPES), which do not depend on the weights' values."""

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.executor import Executor
from kmesh.compute.weights import ModelWeights

TINY_HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Real models' shapes (their Hugging Face configs' sizes), for random weights of that size.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": TINY_HF_CONFIG,
    "smollm2_135m": {
        **TINY_HF_CONFIG,
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
    },
    "llama3_8b": {
        **TINY_HF_CONFIG,
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
}


def random_state_dict(
    seed: int = 0,
    hf_config: Mapping[str, Any] = TINY_HF_CONFIG,
    scale: float = 0.1,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Random weights in Hugging Face Llama naming, made on `device` in `dtype`: normal with
    standard deviation `scale` (norms 1 + that), deterministic in `seed` per device (the same
    weights on every device: make them on the CPU and move them)."""
    cfg = ModelConfig.from_hf(hf_config)
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * scale

    def norm() -> torch.Tensor:
        return 1.0 + rand(cfg.hidden_size)

    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    # NOTE: small embeddings keep the tied output logits soft (entropy ~5 nats of ln 256 = 5.5),
    # so sampling and greedy decoding do not collapse onto one token.
    state = {"model.embed_tokens.weight": rand(cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = norm()
        state[p + "self_attn.q_proj.weight"] = rand(cfg.num_heads * cfg.head_dim, h)
        state[p + "self_attn.k_proj.weight"] = rand(kv, h)
        state[p + "self_attn.v_proj.weight"] = rand(kv, h)
        state[p + "self_attn.o_proj.weight"] = rand(h, cfg.num_heads * cfg.head_dim)
        state[p + "post_attention_layernorm.weight"] = norm()
        state[p + "mlp.gate_proj.weight"] = rand(cfg.intermediate_size, h)
        state[p + "mlp.up_proj.weight"] = rand(cfg.intermediate_size, h)
        state[p + "mlp.down_proj.weight"] = rand(h, cfg.intermediate_size)
    state["model.norm.weight"] = norm()
    if not cfg.tie_word_embeddings:
        state["lm_head.weight"] = rand(cfg.vocab_size, h)
    return state


def tiny_executor(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[Executor, str]:
    """An executor over tiny random weights, and a fingerprint that changes with `seed`."""
    cfg = ModelConfig.from_hf(TINY_HF_CONFIG)
    weights = ModelWeights.from_state_dict(random_state_dict(seed), cfg, dtype)
    fingerprint = hashlib.sha256(f"kmesh-tiny-llama-seed-{seed}".encode()).hexdigest()
    return Executor(cfg, weights), fingerprint
