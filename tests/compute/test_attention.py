import torch

from kmesh.compute.attention import attend, attend_with_lse, merge


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
