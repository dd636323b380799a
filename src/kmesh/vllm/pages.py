"""Rows of vLLM's paged KV cache as KMesh's dense [layers, n, kv_heads, head_dim], and a block's
page of each layer as it lies in memory, for every attention backend whose pages KMesh knows.

vLLM 0.32 gives each attention layer a view [blocks, kv_heads, block_size, content] of one backing
allocation, strided by the engine's KV cache layout (vllm/v1/kv_cache_layout.py::KVCacheLayout, a
permutation of [layer, block, head, token, content] that the engine core resolves once from the
layouts its backends declare, `supported_kv_cache_layouts`). What the content holds is the
backend's own reading of it, and that is the page format:

- `cpu` (CPU_ATTN): each page reread as [kv_heads, 2 * block_size, head_size], keys transposed
  ([head_size, block_size] per head) then values; written through vLLM's own op (cpu_pages.py).
- `kv_split` (FLASH_ATTN, FLASHINFER, TRITON_ATTN): the content is K then V, `kv_cache.transpose(
  1, 2).split(head_size, dim=-1)` as their kernels read it, in any of the layouts (split_pages.py).

A page's bytes are moved in their physical order (`page`), so a stored block restores into any
engine of the same format, layout, dtype and geometry, and into no other (layout.py's meta).
page_formats.py reads the format from vLLM and refuses what KMesh cannot read.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch


class Pages(ABC):
    """One worker's KV pages: `layers` are vLLM's per-layer views in layer order."""

    def __init__(self, layers: Sequence[torch.Tensor], block_size: int) -> None:
        self.layers = list(layers)
        self.block_size = block_size

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    @abstractmethod
    def read(
        self, block_ids: Sequence[int], positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [layers, n, kv_heads, head_dim] of a request's rows at `positions` [n], in
        the cache's dtype, on its device."""

    @abstractmethod
    def write(
        self, block_ids: Sequence[int], positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write K and V [layers, n, kv_heads, head_dim] into a request's rows at `positions`
        (rounded to the cache's dtype if theirs differs)."""

    @abstractmethod
    def page(self, layer: int, block: int) -> torch.Tensor:
        """One layer's page of one block, a view whose row-major order is its memory order."""

    def table(self, block_ids: Sequence[int], positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(block, offset in it) of each position, on the cache's device."""
        table = torch.tensor(block_ids, dtype=torch.int64)
        positions = positions.to(torch.int64).cpu()
        blocks = table[positions // self.block_size]
        offsets = positions % self.block_size
        return blocks.to(self.device), offsets.to(self.device)
