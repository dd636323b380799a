"""Rotary position embedding (the Llama / rotate-half convention).

RoPE rotates each pair of channels (i, i + head_dim/2) by angle position * inv_freq[i]. Because it
is a rotation, a key rotated for position p is moved to position p + d exactly by rotating it by d.

The rotation is computed in float32 whatever the input's dtype and rounded once to it, as vLLM's
CPU kernel does (`rotary_embedding`, csrc/cpu/pos_encoding.cpp); the cos/sin tables are used as
given (the executor rounds them to the model's dtype, as vLLM's cos_sin_cache is).
"""

import torch


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [n, head_dim] for integer `positions` of shape [n]."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` of shape [..., n, heads, head_dim] by per-token angles ([n, head_dim] cos/sin):
    in float32, the result in x's dtype (a float32 temporary of x's size for a narrower x)."""
    x32 = x.float()
    cos = cos[:, None, :].float()
    sin = sin[:, None, :].float()
    return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)
