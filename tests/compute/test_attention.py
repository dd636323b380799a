import torch

from kmesh.compute.attention import (
    _FLASH_CPU,
    FOLD_QUERIES,
    _heads_first,
    _with_lse_by_matmul,
    additive_mask,
    attend,
    attend_with_lse,
    merge,
)


def _qkv(
    seed: int, n: int, m: int
) -> tuple[torch.Generator, torch.Tensor, torch.Tensor, torch.Tensor]:
    """n queries of 6 heads, m keys and values of 2 kv heads (GQA), head dim 8."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, 6, 8, generator=gen)
    return gen, q, torch.randn(m, 2, 8, generator=gen), torch.randn(m, 2, 8, generator=gen)


def _random_mask(gen: torch.Generator, n: int, m: int, blocked: float) -> torch.Tensor:
    """A random [n, m] mask that lets every query see key 0."""
    mask = torch.rand(n, m, generator=gen) > blocked
    mask[:, 0] = True
    return mask


def test_split_attention_merged_by_lse_equals_attention_over_the_union():
    gen, q, k, v = _qkv(0, 5, 30)
    mask = _random_mask(gen, 5, 30, 0.3)
    mask[:, 12] = True
    whole = attend(q, k, v, mask)
    out_a, lse_a = attend_with_lse(q, k[:12], v[:12], mask[:, :12])
    out_b, lse_b = attend_with_lse(q, k[12:], v[12:], mask[:, 12:])
    torch.testing.assert_close(merge(out_a, lse_a, out_b, lse_b)[0], whole, atol=1e-5, rtol=0)
    alone, _ = attend_with_lse(q, k, v, mask)
    torch.testing.assert_close(alone, whole, atol=1e-5, rtol=0)


def test_causal_attention_equals_the_lower_triangular_mask_and_merges_after_a_prefix():
    _, q, k, v = _qkv(1, 7, 10)
    # Three prefix keys every query sees, then 7 new tokens, each seeing those up to itself.
    mask = torch.ones(7, 10, dtype=torch.bool)
    mask[:, 3:] = torch.ones(7, 7, dtype=torch.bool).tril()
    whole = attend(q, k, v, mask)
    causal = attend(q, k[3:], v[3:], None, causal=True)
    assert torch.equal(causal, attend(q, k[3:], v[3:], mask[:, 3:]))
    out_a, lse_a = attend_with_lse(q, k[:3], v[:3], None)
    out_b, lse_b = attend_with_lse(q, k[3:], v[3:], None, causal=True)
    torch.testing.assert_close(merge(out_a, lse_a, out_b, lse_b)[0], whole, atol=1e-5, rtol=0)


def test_the_matrix_product_path_for_other_devices_equals_the_cpu_kernel():
    gen, q, k, v = _qkv(2, 9, 20)
    for mask in (_random_mask(gen, 9, 20, 0.4), None):
        out, lse = attend_with_lse(q, k, v, mask)
        out_mm, lse_mm = _with_lse_by_matmul(q, k, v, None if mask is None else additive_mask(mask))
        torch.testing.assert_close(out_mm, out, atol=1e-5, rtol=0)
        torch.testing.assert_close(lse_mm, lse, atol=1e-5, rtol=0)


def test_few_unmasked_queries_folded_by_kv_head_equal_the_gqa_kernel():
    for n in (1, 3, FOLD_QUERIES):
        _, q, k, v = _qkv(3 + n, n, 40)
        out, lse = attend_with_lse(q, k, v, None)  # folded
        gqa_out, gqa_lse = _FLASH_CPU(*_heads_first(q, k, v))[:2]
        torch.testing.assert_close(out, gqa_out[0].transpose(0, 1), atol=1e-6, rtol=0)
        torch.testing.assert_close(lse, gqa_lse[0].transpose(0, 1), atol=1e-6, rtol=0)
        torch.testing.assert_close(out, attend(q, k, v, None).float(), atol=1e-6, rtol=0)
