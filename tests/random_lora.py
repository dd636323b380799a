"""Random LoRA adapters for unit tests (real, trained adapters come from kmesh.adapters)."""

import hashlib

import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.lora import PROJECTIONS, LoraAdapter


def random_adapter(
    config: ModelConfig,
    seed: int,
    *,
    rank: int = 4,
    invocation: tuple[int, ...] | None = None,
    scale: float = 0.5,
    name: str | None = None,
) -> LoraAdapter:
    """An adapter on every attention projection with random A and B (B non-zero, unlike a fresh
    peft adapter, so it changes the model)."""
    gen = torch.Generator().manual_seed(seed)
    q_out = config.num_heads * config.head_dim
    kv_out = config.num_kv_heads * config.head_dim
    shapes = {
        "q_proj": (config.hidden_size, q_out),
        "k_proj": (config.hidden_size, kv_out),
        "v_proj": (config.hidden_size, kv_out),
        "o_proj": (q_out, config.hidden_size),
    }
    weights = {}
    for layer in range(config.num_layers):
        for projection in PROJECTIONS:
            fan_in, fan_out = shapes[projection]
            a = torch.randn(rank, fan_in, generator=gen) * scale / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=gen) * scale
            weights[(layer, projection)] = (a, b)
    fingerprint = hashlib.sha256(f"random-adapter-{seed}-{invocation}".encode()).hexdigest()
    return LoraAdapter(name or f"random-{seed}", fingerprint, rank, 1.0, weights, invocation)
