"""vLLM's CPU attention pages (CPU_ATTN, page format `cpu`; pages.py says how formats are chosen).

vLLM's CPU attention rereads each layer's [blocks, kv_heads, block_size, 2 * head_size] view as
[blocks, kv_heads, 2 * block_size, head_size]: a block's page per head holds the keys stored
transposed ([head_size, block_size]) and then the values ([block_size, head_size]). Reading
inverts that; writing goes through vLLM's own op (`cpu_attn_reshape_and_cache`, with the attention
layer's ISA), so what is written is vLLM's layout by construction.

Rows are read and written in the cache's dtype: reads gather just the rows asked for, writes
convert one layer's rows at a time; the cache itself is never converted.
"""

from collections.abc import Sequence
from typing import Any

import torch

from kmesh.vllm.pages import Pages


class CpuPages(Pages):
    def __init__(
        self, layers: Sequence[torch.Tensor], block_size: int, attention: Sequence[Any]
    ) -> None:
        """`attention`: each layer's vLLM attention module (its `isa`, set once the backend's
        metadata builder exists, is read when writing)."""
        super().__init__(layers, block_size)
        self.attention = list(attention)

    def _split(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache [N, H, B, D] as vLLM's op wants it, value_cache [N, H, B, D])."""
        pages = layer.view(layer.shape[0], layer.shape[1], 2 * self.block_size, -1)
        key_cache, value_cache = pages.chunk(2, dim=2)
        return key_cache, value_cache

    def page(self, layer: int, block: int) -> torch.Tensor:
        return self.layers[layer][block]

    def read(
        self, block_ids: Sequence[int], positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Consecutive positions (a prefix, a piece) are read a page at a time (the rows then
        views of the pages read: copy what is kept); any others row by row."""
        n = positions.numel()
        if (
            n
            and int(positions[-1]) - int(positions[0]) == n - 1
            and bool((positions.diff() == 1).all())
        ):
            return self._read_pages(block_ids, int(positions[0]), n)
        blocks, offsets = self.table(block_ids, positions)
        ks, vs = [], []
        for layer in self.layers:
            key_cache, value_cache = self._split(layer)
            pages, heads, block, dim = key_cache.shape
            keys = key_cache.view(pages, heads, dim, block)  # stored transposed
            ks.append(keys[blocks, :, :, offsets])
            vs.append(value_cache[blocks, :, offsets, :])
        return torch.stack(ks), torch.stack(vs)

    def _read_pages(
        self, block_ids: Sequence[int], start: int, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [start, start + n): the pages holding them gathered whole, turned to rows on the
        way (one pass per layer), the rows asked for returned as views of them."""
        bs = self.block_size
        first, last = start // bs, (start + n - 1) // bs
        table = torch.tensor(block_ids[first : last + 1], dtype=torch.int64)
        rows = slice(start - first * bs, start - first * bs + n)
        key_cache, _ = self._split(self.layers[0])
        pages, heads, _, dim = key_cache.shape
        shape = (len(self.layers), len(table), bs, heads, dim)
        k = torch.empty(shape, dtype=key_cache.dtype)
        v = torch.empty(shape, dtype=key_cache.dtype)
        for index, layer in enumerate(self.layers):
            key_cache, value_cache = self._split(layer)
            keys = key_cache.view(pages, heads, dim, bs).permute(0, 3, 1, 2)  # stored transposed
            torch.index_select(keys, 0, table, out=k[index])
            torch.index_select(value_cache.permute(0, 2, 1, 3), 0, table, out=v[index])
        return k.flatten(1, 2)[:, rows], v.flatten(1, 2)[:, rows]

    def write(
        self, block_ids: Sequence[int], positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        from vllm import _custom_ops as ops

        blocks, offsets = self.table(block_ids, positions)
        slots = blocks * self.block_size + offsets
        for index, (layer, attention) in enumerate(zip(self.layers, self.attention, strict=True)):
            key_cache, value_cache = self._split(layer)
            ops.cpu_attn_reshape_and_cache(
                k[index].to(key_cache.dtype).contiguous(),
                v[index].to(value_cache.dtype).contiguous(),
                key_cache,
                value_cache,
                slots,
                attention.isa,
            )
