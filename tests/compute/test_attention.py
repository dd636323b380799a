import torch

from kmesh.compute.attention import _with_lse_by_matmul, attend, attend_with_lse, merge


def test_split_attention_merged_by_lse_equals_attention_over_the_union():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 6, 8, generator=gen)
    k = torch.randn(30, 2, 8, generator=gen)
    v = torch.randn(30, 2, 8, generator=gen)
    mask = torch.rand(5, 30, generator=gen) > 0.3
    mask[:, 0] = True
    mask[:, 12] = True
    whole = attend(q, k, v, mask)
    out_a, lse_a = attend_with_lse(q, k[:12], v[:12], mask[:, :12])
    out_b, lse_b = attend_with_lse(q, k[12:], v[12:], mask[:, 12:])
    torch.testing.assert_close(merge(out_a, lse_a, out_b, lse_b), whole, atol=1e-5, rtol=0)
    alone, _ = attend_with_lse(q, k, v, mask)
    torch.testing.assert_close(alone, whole, atol=1e-5, rtol=0)


def test_causal_attention_equals_the_lower_triangular_mask_and_merges_after_a_prefix():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(7, 6, 8, generator=gen)
    k = torch.randn(10, 2, 8, generator=gen)
    v = torch.randn(10, 2, 8, generator=gen)
    # Three prefix keys every query sees, then 7 new tokens, each seeing those up to itself.
    mask = torch.ones(7, 10, dtype=torch.bool)
    mask[:, 3:] = torch.ones(7, 7, dtype=torch.bool).tril()
    whole = attend(q, k, v, mask)
    causal = attend(q, k[3:], v[3:], None, causal=True)
    assert torch.equal(causal, attend(q, k[3:], v[3:], mask[:, 3:]))
    out_a, lse_a = attend_with_lse(q, k[:3], v[:3], None)
    out_b, lse_b = attend_with_lse(q, k[3:], v[3:], None, causal=True)
    torch.testing.assert_close(merge(out_a, lse_a, out_b, lse_b), whole, atol=1e-5, rtol=0)


def test_the_matrix_product_path_for_other_devices_equals_the_cpu_kernel():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(9, 6, 8, generator=gen)
    k = torch.randn(20, 2, 8, generator=gen)
    v = torch.randn(20, 2, 8, generator=gen)
    mask = torch.rand(9, 20, generator=gen) > 0.4
    mask[:, 0] = True
    for m in (mask, None):
        out, lse = attend_with_lse(q, k, v, m)
        out_mm, lse_mm = _with_lse_by_matmul(q, k, v, m)
        torch.testing.assert_close(out_mm, out, atol=1e-5, rtol=0)
        torch.testing.assert_close(lse_mm, lse, atol=1e-5, rtol=0)
