"""Rotary position embedding (the Llama / rotate-half convention), per layer's RoPE table.

RoPE rotates each pair of channels (i, i + head_dim/2) by angle position * inv_freq[i]. Because it
is a rotation, a key rotated for position p is moved to position p + d exactly by rotating it by d.

The rotation is computed in float32 whatever the input's dtype and rounded once to it, as vLLM's
CPU kernel does (`rotary_embedding`, csrc/cpu/pos_encoding.cpp); the cos/sin tables are used as
given (the executor rounds them to the model's dtype, as vLLM's cos_sin_cache is).

Re-rotation (`rerotate_keys`) moves stored keys to new positions without recomputing them: turns
compose by adding angles, so a key computed at position p is moved to position q by turning it by
(q - p) * inv_freq[i]. A model whose layers use different tables (Gemma 3's local and global
thetas) turns each layer's keys by its own table. Values carry no position and never change. Only
the key's position changes:
what the key attended to when it was computed (its context) is not corrected by this; that is what
recovery's selective recomputation is for. Keys keep their dtype: the turn is computed in float32
and rounded once, so a bfloat16 key moves with one bfloat16 rounding, the same as a key RoPE'd
there by the forward pass.
"""

import torch

from kmesh.compute.config import ModelConfig, RopeTable


def inverse_frequencies(table: RopeTable) -> torch.Tensor:
    """The table's frequencies, [head_dim / 2] float32."""
    return torch.tensor(table.inv_freq, dtype=torch.float32)


def layer_frequencies(config: ModelConfig) -> torch.Tensor:
    """Every layer's frequencies, [layers, head_dim / 2] float32 (layers of one RoPE table
    share a row's values)."""
    return torch.tensor([layer.rope.inv_freq for layer in config.layers], dtype=torch.float32)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [..., n, head_dim] for integer `positions` of shape [n] and
    frequencies [..., head_dim / 2] (one table, or one per layer)."""
    freqs = positions.float()[:, None] * inv_freq[..., None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` of shape [..., n, heads, head_dim] by per-token angles ([n, head_dim] cos/sin):
    x * cos + rotate_half(x) * sin in float32, the result in x's dtype (`turn_into`)."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _turn(x, cos[:, None, :].float(), sin[:, None, :].float(), out)
    return out.to(x.dtype)


def turn_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """Write `x` rotated by cos/sin (broadcast to x's shape: one [head_dim] row turns every
    token by one angle) into `out`, which must not overlap x: computed in float32 and rounded
    once to out's dtype, the same bits as apply_rope with those angles."""
    if out.dtype == torch.float32:
        _turn(x, cos.float(), sin.float(), out)
    else:
        out32 = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        _turn(x, cos.float(), sin.float(), out32)
        out.copy_(out32)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """out (float32) = x * cos + rotate_half(x) * sin, rotate_half(x) * sin applied half by half
    (x_lo * cos - x_hi * sin, x_hi * cos + x_lo * sin): the same roundings as forming it whole,
    with temporaries of half x's size (plus a float32 copy of a narrower x) instead of five of
    its size; a big temporary costs its first-touch page faults."""
    half = x.shape[-1] // 2
    x32 = x.float()
    torch.mul(x32, cos, out=out)
    out[..., :half] -= x32[..., half:] * sin[..., :half]
    out[..., half:] += x32[..., :half] * sin[..., half:]


def rerotate_keys(
    keys: torch.Tensor,
    from_positions: torch.Tensor,
    to_positions: torch.Tensor,
    config: ModelConfig,
) -> torch.Tensor:
    """Keys [layers, n, kv_heads, head_dim] computed at `from_positions` [n], as if computed at
    `to_positions` [n], in the keys' dtype: each layer turned by its own table's frequencies
    (the pure rotation: a table's attention_factor is in the key already)."""
    inv_freq = layer_frequencies(config).to(keys.device)
    cos, sin = rope_cos_sin(to_positions - from_positions, inv_freq)  # [layers, n, head_dim]
    out = torch.empty(keys.shape, dtype=torch.float32, device=keys.device)
    _turn(keys, cos[:, :, None, :], sin[:, :, None, :], out)
    return out.to(keys.dtype)
