"""Attention kernels for the executor (GQA, by-position causality).

`attend` is the plain path (torch's scaled_dot_product_attention). `attend_with_lse` also returns
each query's log-sum-exp, so attention over a context split in two parts can be merged exactly:
softmax over the union equals the two partial softmaxes reweighted by exp(lse_part - lse_union).
That is how sequences sharing a prefix attend to it once, together (shared-prefix or "cascade"
attention, as in Hydragen / FlashInfer), instead of each gathering its own copy.

Outputs are in q's dtype. Everything else (scores, softmax, the weighted sum of values, the merge)
is computed in float32 from float32 copies of one layer's q, k and v, and rounded once, as vLLM's
CPU attention kernel does for bfloat16 (torch's own bfloat16 kernel would round the probabilities
to bfloat16 before the weighted sum); the log-sum-exps are float32.
"""

import math

import torch
import torch.nn.functional as F


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """q [n, heads, d], k/v [m, kv_heads, d], mask [n, m] (True = may attend) -> [n, heads, d]."""
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        attn_mask=None if mask is None else mask[None, None],
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).to(q.dtype)


def attend_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `attend`, plus the log-sum-exp (float32) of each query's scores, [n, heads]. Every
    query must be allowed at least one key."""
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    # Query head h reads kv head h // group: gather each kv head's queries into one matrix.
    qh = q.float().view(n, kv_heads, group, d).permute(1, 0, 2, 3).reshape(kv_heads, n * group, d)
    scores = torch.bmm(qh, k.float().permute(1, 2, 0)) * (1.0 / math.sqrt(d))
    if mask is not None:
        blocked = ~mask[None, :, None, :].expand(kv_heads, n, group, mask.shape[1])
        scores = scores.masked_fill(blocked.reshape(kv_heads, n * group, -1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.bmm(torch.exp(scores - lse[..., None]), v.float().transpose(0, 1))
    out = out.view(kv_heads, n, group, d).permute(1, 0, 2, 3).reshape(n, heads, d)
    return out.to(q.dtype), lse.view(kv_heads, n, group).permute(1, 0, 2).reshape(n, heads)


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over the union of two disjoint key sets, from each set's output and lse (in
    out_a's dtype)."""
    lse = torch.logaddexp(lse_a.float(), lse_b.float())
    a = out_a.float() * torch.exp(lse_a - lse)[..., None]
    return (a + out_b.float() * torch.exp(lse_b - lse)[..., None]).to(out_a.dtype)
