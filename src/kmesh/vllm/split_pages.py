"""The pages of vLLM's GPU attention backends that keep K and V side by side in a page's content
(FLASH_ATTN, FLASHINFER, TRITON_ATTN: page format `kv_split`; page_formats.py says how formats are
chosen).

Each layer's view is [blocks, kv_heads, block_size, 2 * head_size], and its kernels read it as
`kv_cache.transpose(1, 2).split(head_size, dim=-1)`: a row's keys are content [:head_size], its
values [head_size:]. Where those bytes lie is the engine's KV cache layout (KVCacheLayout: the
view's strides, set by vLLM's `create_kv_cache_views`); rows are read and written through the
view, so every one of the six layouts is the same code, and a page is handed out permuted to its
memory order (`layer_view_order`: the engine's KVCacheLayout's, read by page_formats.pages_for).

Reads and writes index the view on its device (no vLLM op: the backends' own cache-write kernels
exist on GPUs only); rows are written rounded to the cache's dtype. Torch alone: tests/test_cuda.py
runs it on a GPU without vLLM.
"""

from collections.abc import Sequence

import torch

from kmesh.vllm.pages import Pages


class SplitPages(Pages):
    def __init__(
        self, layers: Sequence[torch.Tensor], block_size: int, layer_view_order: Sequence[int]
    ) -> None:
        """`layer_view_order`: the memory order of a layer's [block, head, token, content] axes
        (vLLM's KVCacheLayout.layer_view_order)."""
        super().__init__(layers, block_size)
        self._page_order = tuple(axis - 1 for axis in layer_view_order if axis != 0)
        self.head_size = self.layers[0].shape[-1] // 2

    def page(self, layer: int, block: int) -> torch.Tensor:
        return self.layers[layer][block].permute(self._page_order)

    def read(
        self, block_ids: Sequence[int], positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, offsets = self.table(block_ids, positions)
        d = self.head_size
        rows = torch.stack([layer[blocks, :, offsets] for layer in self.layers])
        return rows[..., :d], rows[..., d:]

    def write(
        self, block_ids: Sequence[int], positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        blocks, offsets = self.table(block_ids, positions)
        d = self.head_size
        for index, layer in enumerate(self.layers):
            layer[blocks, :, offsets, :d] = k[index].to(layer.device, layer.dtype)
            layer[blocks, :, offsets, d:] = v[index].to(layer.device, layer.dtype)
