"""A segment's KV at canonical positions, placeable at any offset by exact re-rotation.

Keys are stored as if the segment's tokens sat at positions 0..n-1; `placed` turns them to the
positions where a prompt puts the segment. Values carry no position and are shared as they are.
Re-rotation fixes positions only; the context the KV was computed in stays (recovery's job).
KV stays in the dtype it was computed in (the KV cache's: float32 or bfloat16); turns are
computed in float32 (compute/rope.py).
"""

from dataclasses import dataclass

import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.rope import rerotate_keys


@dataclass(frozen=True, slots=True)
class SegmentKV:
    k: torch.Tensor  # [layers, n, kv_heads, head_dim], keys at positions 0..n-1
    v: torch.Tensor  # [layers, n, kv_heads, head_dim]

    def __len__(self) -> int:
        return self.k.shape[1]

    @classmethod
    def canonical(
        cls, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, config: ModelConfig
    ) -> "SegmentKV":
        """From KV computed at `positions` [n] (its own copy of them: k and v may be views of a
        bigger tensor, which it then does not keep)."""
        if k.shape != v.shape or k.shape[1] != len(positions):
            raise ValueError(
                f"segment KV shapes disagree: k {tuple(k.shape)}, v {tuple(v.shape)}, "
                f"{len(positions)} positions"
            )
        canonical = torch.arange(len(positions), device=k.device)
        return cls(rerotate_keys(k, positions, canonical, config), v.contiguous())

    def placed(
        self, positions: torch.Tensor, config: ModelConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) with the keys turned to `positions` [n]."""
        canonical = torch.arange(len(self), device=self.k.device)
        return rerotate_keys(self.k, canonical, positions, config), self.v
