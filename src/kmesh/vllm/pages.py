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
engine of the same format, layout, dtype and geometry, and into no other (layout.py's meta). A
backend not listed, a quantized cache, or a layout the backend does not declare is refused at
start, in one line.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

# vLLM's attention backend name (AttentionBackend.get_name()) -> the page format KMesh reads.
PAGE_FORMATS = {
    "CPU_ATTN": "cpu",
    "FLASH_ATTN": "kv_split",
    "FLASHINFER": "kv_split",
    "TRITON_ATTN": "kv_split",
}
# What the page formats hold: float caches only (a quantized cache's bytes need its scales).
PAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def page_format(backend: Any, layout: str, dtype: torch.dtype) -> str:
    """The page format of a vLLM attention backend class running the engine's resolved
    `layout` (a KVCacheLayout name) with a cache of `dtype`, as layout.py's meta names it
    (`cpu:LBHNC`, `kv_split:LBNHC`); ValueError in one line where KMesh cannot read its pages."""
    name = backend.get_name()
    kind = PAGE_FORMATS.get(name)
    if kind is None:
        known = ", ".join(PAGE_FORMATS)
        raise ValueError(
            f"KMeshConnector reads the KV pages of the attention backends {known}; this engine "
            f"runs {name}: pick one of them (--attention-backend) or run without KMeshConnector"
        )
    if dtype not in PAGE_DTYPES:
        raise ValueError(
            f"KMeshConnector copies float KV caches (float32, bfloat16, float16); this engine's "
            f"is {dtype}: run it without --kv-cache-dtype"
        )
    declared = backend.supported_kv_cache_layouts()
    if declared is not None and layout not in [each.name for each in declared]:
        names = ", ".join(each.name for each in declared)
        raise ValueError(
            f"the engine resolved the KV cache layout {layout}, which {name} does not declare "
            f"({names}): unset VLLM_KV_CACHE_LAYOUT"
        )
    return f"{kind}:{layout}"


def pages_for(
    format_: str,
    layers: Sequence[torch.Tensor],
    block_size: int,
    attention_layers: dict[str, Any],
    names: Sequence[str],
) -> Pages:
    """The Pages of a page format (page_format) over vLLM's per-layer views."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kmesh.vllm.cpu_pages import CpuPages
    from kmesh.vllm.split_pages import SplitPages

    kind, layout = format_.split(":")
    if kind == "cpu":
        return CpuPages(layers, block_size, [attention_layers[name] for name in names])
    return SplitPages(layers, block_size, KVCacheLayout[layout].layer_view_order)
