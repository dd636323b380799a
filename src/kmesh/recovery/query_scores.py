"""Query-aware recovery's scores (ProphetKV's rule): how much a region's new tokens attend to each
of its reusable tokens at the check layer.

A region's new tokens (its non-reusable ones: in an agent's prompt, its own instruction and
question after the reused sibling messages) are what will read the reused KV. Recovery's first
phase runs them through layers 0..c (the check layer c) against the exact prefix and the reused
KV of the rest; `QueryCapture` keeps their normed input at layer c as that forward makes it, and
`reusable_attention` turns it into their queries (`Executor.queries_keys`: QK-norm and RoPE as
forward) and scores every reusable token r as

    score(r) = mean over asking new tokens n and query heads h of
               softmax over the reusable tokens n may see of (q[n, h] . k[r, kv(h)] * scale)

with k the reused keys at layer c (already at their positions), kv(h) = h // (heads // kv_heads)
the key head a grouped query head reads, and scale the model's attention scale; in float32. A new
token may see the reusable tokens at lower positions (and, on a sliding-window layer, inside its
window); one that sees none does not ask and is left out of the mean. The softmax runs over the
reusable tokens alone (not the prefix, not the other new tokens): the score is the share of the
reused part's attention a token draws, a ranking signal rather than the model's own weights.
The scores cost no token-layer beyond the first phase's (the caller counts that one).
"""

from dataclasses import dataclass, field
from typing import Protocol

import torch

from kmesh.compute.executor import Executor

# Most query-head x key scores held at once (float32): asking tokens are scored in chunks below it.
SCORE_CHUNK_ELEMENTS = 1 << 24


class Region(Protocol):
    """What the scores read of a region (recover.RegionInput)."""

    @property
    def positions(self) -> torch.Tensor: ...  # [t]

    @property
    def reusable(self) -> torch.Tensor: ...  # [t] bool


@dataclass(slots=True)
class QueryCapture:
    """An `on_layer_input` hook for Executor.forward: at `layer`, keeps the normed input of the
    rows `asking[s]` ([n_s] bool over sequence s's tokens) of each sequence s of the batch in
    `inputs[s]`."""

    layer: int
    asking: list[torch.Tensor]
    inputs: list[torch.Tensor] = field(default_factory=list)

    def __call__(self, layer: int, h: torch.Tensor) -> None:
        if layer == self.layer:
            parts = h.split([len(rows) for rows in self.asking])
            self.inputs = [part[rows] for part, rows in zip(parts, self.asking, strict=True)]


def asks(region: Region) -> bool:
    """Whether some new token of the region follows a reusable one: only then may it score one."""
    new, old = region.positions[~region.reusable], region.positions[region.reusable]
    return len(new) > 0 and len(old) > 0 and bool(new.max() > old.min())


@torch.inference_mode()
def reusable_attention(
    executor: Executor,
    layer: int,
    h: torch.Tensor,
    region: Region,
    keys: torch.Tensor,
) -> torch.Tensor | None:
    """[t] float32 score (module docstring) of each of a region's t tokens, 0 where not reusable:
    `keys` [t, kv_heads, head_dim] are its reused keys at `layer` (rows not reusable ignored),
    `h` [n, hidden] the normed input at `layer` of its n new tokens (the rows not reusable, in
    order). None when no new token sees a reusable one: nothing asks."""
    cfg = executor.config
    positions, reusable = region.positions, region.reusable
    new = torch.nonzero(~reusable)[:, 0]
    old = torch.nonzero(reusable)[:, 0]
    q_positions, k_positions = positions[new], positions[old]
    visible = k_positions[None, :] < q_positions[:, None]
    window = cfg.layers[layer].window
    if window is not None:
        visible &= k_positions[None, :] > q_positions[:, None] - window
    asking = visible.any(dim=1)
    if not bool(asking.any()):
        return None
    q, _ = executor.queries_keys(layer, h[asking], q_positions[asking])
    visible = visible[asking]
    n, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    q = q.float().view(n, kv_heads, heads // kv_heads, head_dim)
    k = keys[old].float()
    total = torch.zeros(len(old), dtype=torch.float32, device=positions.device)
    chunk = max(1, SCORE_CHUNK_ELEMENTS // (heads * len(old)))
    for start in range(0, n, chunk):
        logits = torch.einsum("nkgd,mkd->nkgm", q[start : start + chunk], k) * cfg.attention_scale
        mask = visible[start : start + chunk, None, None, :]
        weights = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
        total += weights.sum(dim=(0, 1, 2))
    scores = torch.zeros(len(positions), dtype=torch.float32, device=positions.device)
    scores[old] = total / (n * heads)
    return scores
