"""Random-weight Llamas for tests where real weights do not matter (exactness): the tiny one by
default, or any Llama shape given as a Hugging Face config."""

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.executor import Executor
from kmesh.compute.weights import LlamaWeights

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


def tiny_state_dict(
    seed: int = 0, hf_config: Mapping[str, Any] = TINY_HF_CONFIG, scale: float = 0.1
) -> dict[str, torch.Tensor]:
    """Random weights in Hugging Face Llama naming, deterministic in `seed`: normal with standard
    deviation `scale` (norms 1 + that)."""
    cfg = ModelConfig.from_hf(hf_config)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

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
    return state


def tiny_executor(
    seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[Executor, str]:
    """An executor over tiny random weights on `device`, and a fingerprint that changes with
    `seed`."""
    cfg = ModelConfig.from_hf(TINY_HF_CONFIG)
    state = {name: w.to(device) for name, w in tiny_state_dict(seed).items()}
    weights = LlamaWeights.from_state_dict(state, cfg, dtype)
    fingerprint = hashlib.sha256(f"kmesh-tiny-llama-seed-{seed}".encode()).hexdigest()
    return Executor(cfg, weights), fingerprint
