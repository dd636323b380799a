"""A stored vLLM block: every attention layer's page of one block, in vLLM's own layout.

vLLM keeps one KV tensor per attention layer, [num_blocks, ...] with one page per block (on CPU
[num_blocks, kv_heads, block_size, 2 * head_size], K transposed inside each block). KMesh stores
whole pages byte for byte, layer after layer, so a restore is one copy per layer and exact on any
backend; the meta names the platform, dtype and page geometry, and an entry whose meta differs
(another platform's layout, another dtype or block size) is a miss.
"""

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class BlockLayout:
    layer_names: tuple[str, ...]  # in layer order
    block_size: int  # tokens per block
    page_bytes: int  # one layer's page of one block
    dtype: torch.dtype  # of the KV cache
    platform: str  # vLLM's device type: the page layout differs between platforms

    @property
    def block_bytes(self) -> int:
        return self.page_bytes * len(self.layer_names)

    @classmethod
    def of(cls, kv_cache_config: Any, block_size: int, platform: str) -> "BlockLayout":
        """From vLLM's KVCacheConfig: one group of full-attention layers is supported."""
        from vllm.model_executor.models.utils import extract_layer_index

        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(
                f"KMeshConnector supports models with one KV cache group, this one has "
                f"{len(groups)} (hybrid or sliding-window models are not supported yet)"
            )
        names = sorted(groups[0].layer_names, key=extract_layer_index)
        spec = groups[0].kv_cache_spec
        return cls(tuple(names), block_size, spec.page_size_bytes, spec.dtype, platform)

    @property
    def meta(self) -> dict[str, Any]:
        """What every stored block says of its layout (checked on each load)."""
        return {
            "engine": "vllm",
            "platform": self.platform,
            "dtype": str(self.dtype),
            "block_size": self.block_size,
            "layers": len(self.layer_names),
            "page_bytes": self.page_bytes,
        }
