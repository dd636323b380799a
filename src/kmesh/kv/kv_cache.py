"""Paged KV tensors: one K and one V row per slot, slot = block_id * block_size + offset."""

import torch

from kmesh.compute.config import ModelConfig


class PagedKVCache:
    """K and V for every layer in `num_blocks` blocks of `block_size` slots.

    Keys are stored after RoPE, as the executor produces them.
    """

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (
            config.num_layers,
            num_blocks * block_size,
            config.num_kv_heads,
            config.head_dim,
        )
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)

    @property
    def bytes_per_block(self) -> int:
        per_slot = self.k[:, 0].numel() * self.k.element_size() * 2
        return per_slot * self.block_size

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot numbers of token positions [start, end) of a sequence with this block table."""
        positions = torch.arange(start, end)
        blocks = torch.tensor(block_table, dtype=torch.long)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer, slots] = k
        self.v[layer, slots] = v

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, slots], self.v[layer, slots]

    def copy_block(self, source: int, destination: int) -> None:
        """Copy one block's K and V, every layer (copy-on-write)."""
        bs = self.block_size
        src = slice(source * bs, (source + 1) * bs)
        dst = slice(destination * bs, (destination + 1) * bs)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


class PagedContext:
    """Positions [start, end) of a sequence's paged KV, as executor context (a ContextKV)."""

    def __init__(self, cache: PagedKVCache, block_table: list[int], start: int, end: int) -> None:
        self._cache = cache
        self._slots = cache.slots(block_table, start, end)
        self.positions = torch.arange(start, end)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cache.read(index, self._slots)
