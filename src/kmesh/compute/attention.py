"""Attention kernels for the executor (GQA, by-position causality).

`attend` is the plain path (torch's scaled_dot_product_attention). `attend_with_lse` also returns
each query's log-sum-exp, so attention over a context split in two parts can be merged exactly:
softmax over the union equals the two partial softmaxes reweighted by exp(lse_part - lse_union).
That is how a context every query sees in full (a prefix, or a trunk that sequences share) is
attended without a mask and without being copied next to the new keys (shared-prefix or
"cascade" attention, as in Hydragen / FlashInfer).

Masks: a boolean [n, m] (True = may attend), None (every key), or `causal` (n == m, query i sees
keys 0..i: what a by-position mask is over new tokens at increasing positions; the kernel then
skips the blocks above the diagonal, with the same result bit for bit).

`attend`'s output is in q's dtype; `attend_with_lse` and `merge` give float32, for the caller to
round once after merging. Everything (scores, softmax, the weighted sum of values, the merge) is
computed in float32 from float32 copies of one layer's q, k and v, as vLLM's CPU attention kernel
does for bfloat16 (torch's own bfloat16 kernel would round the probabilities to bfloat16 before
the weighted sum). On the CPU both functions run torch's flash kernel (the one
scaled_dot_product_attention picks there; it returns the log-sum-exp too); on other devices
`attend_with_lse` is written out in matrix products.
"""

import math

import torch
import torch.nn.functional as F

# The CPU kernel behind scaled_dot_product_attention, returning (output, logsumexp). It takes an
# additive float mask, and kv heads fewer than query heads as they are (GQA).
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
# Queries up to which unmasked attention folds query heads into rows (`_by_kv_head`): with 1-3
# queries of 9 heads over 2,450-5,000 keys of 3 it took half the time of the GQA call; at 66
# queries 1.1x as long (one run each, this machine).
FOLD_QUERIES = 8


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """q [n, heads, d], k/v [m, kv_heads, d], mask [n, m] (True = may attend) -> [n, heads, d].
    Scores are scaled by `scale` (None: 1/sqrt(d))."""
    out = F.scaled_dot_product_attention(
        *_heads_first(q, k, v),
        attn_mask=None if mask is None else mask[None, None],
        is_causal=causal,
        enable_gqa=True,
        scale=scale,
    )
    return out[0].transpose(0, 1).to(q.dtype)


def attend_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `attend`, but the output in float32, plus the log-sum-exp of each query's scores,
    [n, heads]. `mask` may also be `additive_mask`'s (made once for every layer). Every query
    must be allowed at least one key."""
    if mask is not None and mask.dtype == torch.bool:
        mask = additive_mask(mask)
    if q.device.type == "cpu" and mask is None and not causal and len(q) <= FOLD_QUERIES:
        return _by_kv_head(q, k, v, scale)
    if q.device.type == "cpu":
        attn_mask = None if mask is None else mask[None, None]
        out, lse = _FLASH_CPU(
            *_heads_first(q, k, v), is_causal=causal, attn_mask=attn_mask, scale=scale
        )[:2]
        return out[0].transpose(0, 1), lse[0].transpose(0, 1)
    if causal:
        mask = additive_mask(torch.ones(len(q), len(k), dtype=torch.bool, device=q.device).tril())
    return _with_lse_by_matmul(q, k, v, mask, scale)


def _by_kv_head(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked `attend_with_lse` on the CPU kernel with each kv head's query heads folded into
    its query rows: one head of the kernel per kv head, which then reads each kv head's keys once
    rather than once per query head. The same sums as the GQA call; the kernel's tiling of more
    query rows rounds differently (1.4e-7 to 1.9e-7 at 1-66 queries here)."""
    rows = _fold_heads(q, k.shape[1])[None]
    out, lse = _FLASH_CPU(rows, *(x.float().transpose(0, 1)[None] for x in (k, v)), scale=scale)[:2]
    return _unfold_heads(out[0], lse[0], len(q))


def _fold_heads(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [n, heads, d] as float32 [kv_heads, n * group, d]: query head h reads kv head
    h // group, so each kv head's queries become the rows of one matrix."""
    n, heads, d = q.shape
    return (
        q.float()
        .view(n, kv_heads, heads // kv_heads, d)
        .permute(1, 0, 2, 3)
        .reshape(kv_heads, -1, d)
    )


def _unfold_heads(
    out: torch.Tensor, lse: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_fold_heads`'s rows back: out [kv_heads, n * group, d] -> [n, heads, d], lse
    [kv_heads, n * group] -> [n, heads]."""
    kv_heads, rows, d = out.shape
    group = rows // n
    out = out.view(kv_heads, n, group, d).permute(1, 0, 2, 3).reshape(n, kv_heads * group, d)
    return out, lse.view(kv_heads, n, group).permute(1, 0, 2).reshape(n, kv_heads * group)


def additive_mask(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask [n, m] as the float32 one `attend_with_lse` adds to the scores (0 where
    True, -inf where False)."""
    return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))


def _with_lse_by_matmul(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_with_lse` in matrix products, for devices without the CPU kernel (`mask`
    additive)."""
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    qh = _fold_heads(q, kv_heads)
    scores = torch.bmm(qh, k.float().permute(1, 2, 0)) * (scale or 1.0 / math.sqrt(d))
    if mask is not None:
        scores = scores + mask[None, :, None, :].expand(
            kv_heads, n, heads // kv_heads, mask.shape[1]
        ).reshape(kv_heads, qh.shape[1], -1)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.bmm(torch.exp(scores - lse[..., None]), v.float().transpose(0, 1))
    return _unfold_heads(out, lse, n)


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets, from each set's output and lse
    (float32): its output and lse, so that a third set can be merged in."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None]
    return out, lse


def _heads_first(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[1, heads, n, d] float32 views (copies where the dtype differs) of [n, heads, d] tensors."""
    return tuple(x.float().transpose(0, 1)[None] for x in (q, k, v))  # type: ignore[return-value]
