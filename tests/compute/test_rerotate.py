"""Re-rotation against recomputation: the same tokens computed at the new positions.

Attention under RoPE depends only on relative positions, so a run of tokens computed on its own
at offset p or at offset q has the same pre-RoPE keys (up to float reduction noise); re-rotating
the keys from p to q must then give the keys computed at q. Tolerance: fp32 angles at positions
in the thousands carry ~1e-4 rad of rounding in the reference itself, so keys of magnitude O(10)
agree to ~1e-3; the tiny model's O(1) keys to 1e-4.
"""

import pytest
import torch

from kmesh.compute.config import default_frequencies
from kmesh.compute.executor import SequenceInput
from kmesh.compute.rope import apply_rope, rerotate_keys, rope_cos_sin
from tests.conftest import random_tokens, rope_pair_norms


def keys_at(executor, tokens, offset):
    positions = torch.arange(offset, offset + len(tokens))
    return executor.forward([SequenceInput(torch.tensor(tokens), positions)])[0].k, positions


@pytest.mark.parametrize(("p", "q"), [(0, 7), (100, 3), (5, 3000)])
def test_rerotated_keys_equal_keys_computed_there(tiny, p, q):
    executor, _ = tiny
    tokens = random_tokens(24, seed=p + q)
    k_p, pos_p = keys_at(executor, tokens, p)
    k_q, pos_q = keys_at(executor, tokens, q)
    moved = rerotate_keys(torch.stack(k_p), pos_p, pos_q, executor.config)
    torch.testing.assert_close(moved, torch.stack(k_q), atol=1e-4, rtol=1e-4)


def test_rerotation_is_not_a_no_op(tiny):
    executor, _ = tiny
    k_p, pos_p = keys_at(executor, random_tokens(8, seed=1), 0)
    moved = rerotate_keys(torch.stack(k_p), pos_p, pos_p + 5, executor.config)
    assert (moved[0] - k_p[0]).abs().max() > 0.01


@pytest.mark.model
def test_rerotation_on_the_real_model(real_model):
    executor = real_model.executor
    tokens = random_tokens(64, seed=2, high=real_model.config.vocab_size)
    k_p, pos_p = keys_at(executor, tokens, 40)
    k_q, pos_q = keys_at(executor, tokens, 2100)
    all_moved = rerotate_keys(torch.stack(k_p), pos_p, pos_q, executor.config)
    for layer in (0, 14, 29):
        moved = all_moved[layer]
        scale = k_q[layer].abs().max()
        assert ((moved - k_q[layer]).abs().max() / scale).item() < 1e-3


@pytest.mark.parametrize(("dtype", "bound"), [(torch.bfloat16, 2**-7), (torch.float16, 2**-10)])
def test_half_precision_keys_are_turned_in_float32_and_rounded_once(tiny, dtype, bound):
    """A bfloat16 or float16 KV cache's keys stay in its dtype and move as their float32 values
    do, rounded once: bit for bit the float32 turn rounded to the dtype. Against the float32 turn
    of the unrounded keys that is two roundings (of the key, of the turned key), each at most the
    dtype's unit roundoff (bfloat16 2^-8, float16 2^-11) of an element, hence of its pair's norm,
    which the turn preserves: within twice that of the pair norm."""
    executor, _ = tiny
    keys, positions = keys_at(executor, random_tokens(24, seed=4), 100)
    keys = torch.stack(keys)  # [layers, n, kv_heads, head_dim]
    to = positions + 2900
    rounded = keys.to(dtype)
    moved = rerotate_keys(rounded, positions, to, executor.config)
    assert moved.dtype == dtype
    assert torch.equal(
        moved, rerotate_keys(rounded.float(), positions, to, executor.config).to(dtype)
    )
    reference = rerotate_keys(keys, positions, to, executor.config)
    assert ((moved.float() - reference).abs() <= bound * rope_pair_norms(keys) + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_half_by_half_rounds_as_the_whole_formula_does(dtype):
    # apply_rope adds rotate_half(x) * sin one half at a time to save temporaries; the result
    # must be x * cos + rotate_half(x) * sin bit for bit (vLLM's exactness rests on it).
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 40, 2, 16, generator=gen) * 4).to(dtype)
    positions = torch.randint(0, 9000, (40,), generator=gen)
    cos, sin = rope_cos_sin(positions, default_frequencies(16, 1e4))
    x32, c, s = x.float(), cos[:, None, :], sin[:, None, :]
    whole = (x32 * c + torch.cat((-x32[..., 8:], x32[..., :8]), dim=-1) * s).to(dtype)
    assert torch.equal(apply_rope(x, cos, sin), whole)
