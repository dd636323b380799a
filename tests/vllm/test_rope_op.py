"""KMesh's RoPE as the executor runs it (kmesh/compute/executor.py: the cos/sin table rounded to
the model's dtype, the rotation in float32, rounded once) against vLLM's CPU op
(`rotary_embedding`, what vLLM's Llama runs on CPU). In bfloat16 bit for bit: the single rounding
of a float32 result hides the kernel's fused multiply-adds, which in float32 leave one float32 ulp
(tolerance 1e-6 relative)."""

import pytest
import torch

from kmesh.compute.config import default_frequencies
from kmesh.compute.rope import apply_rope, rope_cos_sin

HEADS, DIM, THETA, MAX_POSITION = 3, 64, 100000.0, 4096


def vllm_cos_sin_cache(dtype: torch.dtype) -> torch.Tensor:
    """vLLM's RotaryEmbedding table (base.py::_compute_cos_sin_cache), in the model's dtype."""
    inv_freq = 1.0 / (THETA ** (torch.arange(0, DIM, 2, dtype=torch.float) / DIM))
    freqs = torch.einsum("i,j -> ij", torch.arange(MAX_POSITION, dtype=torch.float), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.bfloat16, 0.0), (torch.float32, 1e-6)])
def test_rope_equals_vllms_cpu_op(dtype, rtol):
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, MAX_POSITION, (200,), generator=gen)
    query = (torch.randn(200, HEADS * DIM, generator=gen) * 3).to(dtype)
    key = (torch.randn(200, HEADS * DIM, generator=gen) * 3).to(dtype)
    cos, sin = rope_cos_sin(positions, default_frequencies(DIM, THETA))
    cos, sin = cos.to(dtype), sin.to(dtype)
    expected = [apply_rope(x.view(-1, HEADS, DIM), cos, sin) for x in (query, key)]
    ops.rotary_embedding(positions, query, key, DIM, vllm_cos_sin_cache(dtype), True)  # in place
    for got, want in zip((query, key), expected, strict=True):
        torch.testing.assert_close(got.view(-1, HEADS, DIM), want, rtol=rtol, atol=rtol)
