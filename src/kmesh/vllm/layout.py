"""A stored vLLM block: every attention layer's page of one block, in vLLM's own layout.

vLLM keeps one KV tensor per attention layer, [num_blocks, ...] with one page per block (on CPU
[num_blocks, kv_heads, block_size, 2 * head_size], K transposed inside each block). KMesh stores
whole pages byte for byte, layer after layer, so a restore is one copy per layer and exact on any
backend; the meta names the platform, dtype and page geometry, and an entry whose meta differs
(another platform's layout, another dtype or block size) is a miss.

KMesh reads and writes any page of a request (store blocks, page tails, recovery's prefix), so it
needs vLLM to keep every page of every layer in one KV cache group. That holds for full-attention
models, and for models that interleave sliding-window and full layers (Gemma 3): vLLM's CPU
platform, and any engine whose KV connector is not hybrid-aware (KMeshConnector is not), turns off
the hybrid KV cache manager, and vLLM then allocates the windowed layers as full ones, in the same
group as the others (vllm/v1/core/kv_cache_utils.py::unify_hybrid_kv_cache_specs: one
FullAttentionSpec group, every page kept; the layers still attend through their windows). A model
whose every layer has the same window (Mistral) stays one SlidingWindowSpec group, whose pages
outside the window vLLM frees while the request runs: refused, as are several groups.
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
        """From vLLM's KVCacheConfig: one group that keeps every page (module docstring);
        ValueError in one line otherwise."""
        from vllm.model_executor.models.utils import extract_layer_index

        groups = kv_cache_config.kv_cache_groups
        refusal = layout_refusal([group.kv_cache_spec for group in groups])
        if refusal is not None:
            raise ValueError(refusal)
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


def layout_refusal(specs: list[Any]) -> str | None:
    """Why KMeshConnector cannot run on KV cache groups of these specs (vLLM's KVCacheSpec, one
    per group), or None: it needs exactly one group of full-attention pages, all kept."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    kinds = ", ".join(type(spec).__name__ for spec in specs)
    if len(specs) != 1:
        return (
            f"KMeshConnector supports models whose layers share one KV cache group; vLLM made "
            f"{len(specs)} for this one ({kinds}): hybrid models are not supported"
        )
    spec = specs[0]
    if isinstance(spec, SlidingWindowSpec):
        return (
            f"KMeshConnector needs every KV page of a request kept, and vLLM frees the pages "
            f"outside the window of a model whose every layer attends through the same sliding "
            f"window ({spec.sliding_window} tokens, a SlidingWindowSpec group): not supported"
        )
    if type(spec) is not FullAttentionSpec:
        return (
            f"KMeshConnector supports full-attention KV caches (FullAttentionSpec, every page "
            f"kept); this model's is {kinds}"
        )
    return None
