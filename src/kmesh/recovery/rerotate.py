"""Exact RoPE re-rotation: move stored keys to new positions without recomputing them.

Keys are stored after RoPE. RoPE turns each channel pair (i, i + head_dim/2) by the angle
position * inv_freq[i]; turns compose by adding angles, so a key computed at position p is moved to
position q by turning it by (q - p) * inv_freq[i]. Values carry no position and never change.
Only the key's position changes: what the key attended to when it was computed (its context) is
not corrected by this; that is what recovery's selective recomputation is for.

Keys keep their dtype. The turn is computed in float32 (float32 angles, cos and sin; RoPE's
rotation in compute/rope.py) and rounded once to the keys' dtype, so a bfloat16 key moves with one
bfloat16 rounding, the same as a key RoPE'd there by the forward pass.
"""

import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.rope import apply_rope, inverse_frequencies, rope_cos_sin


def rerotate_keys(
    keys: torch.Tensor,
    from_positions: torch.Tensor,
    to_positions: torch.Tensor,
    config: ModelConfig,
) -> torch.Tensor:
    """Keys [..., n, kv_heads, head_dim] (e.g. [layers, n, ...]) computed at `from_positions`
    [n], as if computed at `to_positions` [n], in the keys' dtype."""
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta)
    cos, sin = rope_cos_sin(to_positions - from_positions, inv_freq)
    return apply_rope(keys, cos, sin)
