"""A stored vLLM block: every attention layer's page of one block, in vLLM's own layout.

vLLM keeps one KV view per attention layer, [num_blocks, ...] with one page per block, in the
engine's page format (pages.py: the backend's reading of a page and the KV cache layout). KMesh
stores whole pages byte for byte in their memory order, layer after layer, so a restore is one
copy per layer and exact on any backend; the meta names the platform, page format, dtype, page
geometry and tensor-parallel size, and an entry whose meta differs is not loaded (the worker says
why, and vLLM computes the block).

With tensor parallelism each worker holds its shard of the KV heads (vLLM replicates a KV head
where there are fewer than workers). A stored block is then every rank's pages in rank order
(`rank_bytes` each): the first rank gathers them and writes the entry, each rank loads its own
part (shards.py). An entry written at another tensor-parallel size is refused by its meta.

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
    platform: str  # vLLM's device type
    page_format: str = "cpu:LBHNC"  # pages.py: the backend's page reading and the cache layout
    tp_size: int = 1  # tensor-parallel workers, each with its shard of the KV heads

    @property
    def kv_layout(self) -> str:
        """The engine's KVCacheLayout name, the second half of the page format."""
        return self.page_format.partition(":")[2]

    @property
    def rank_bytes(self) -> int:
        """One worker's pages of one block."""
        return self.page_bytes * len(self.layer_names)

    @property
    def block_bytes(self) -> int:
        """A stored block: every worker's pages."""
        return self.rank_bytes * self.tp_size

    @classmethod
    def of(
        cls,
        kv_cache_config: Any,
        block_size: int,
        platform: str,
        kv_layout: str = "LBHNC",
        tp_size: int = 1,
    ) -> "BlockLayout":
        """From vLLM's KVCacheConfig (one group that keeps every page: module docstring), the
        engine's resolved KVCacheLayout name and its tensor-parallel size; ValueError in one
        line otherwise. The page format follows the platform: vLLM's CPU attention on CPU, a
        K|V-split page elsewhere (the worker checks that its backend agrees:
        page_formats.page_format)."""
        from vllm.model_executor.models.utils import extract_layer_index

        groups = kv_cache_config.kv_cache_groups
        refusal = layout_refusal([group.kv_cache_spec for group in groups])
        if refusal is not None:
            raise ValueError(refusal)
        names = sorted(groups[0].layer_names, key=extract_layer_index)
        spec = groups[0].kv_cache_spec
        kind = "cpu" if platform == "cpu" else "kv_split"
        return cls(
            tuple(names),
            block_size,
            spec.page_size_bytes,
            spec.dtype,
            platform,
            f"{kind}:{kv_layout}",
            tp_size,
        )

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
            "page_format": self.page_format,
            "tensor_parallel_size": self.tp_size,
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


def layout_mismatch(stored: dict[str, Any], here: dict[str, Any]) -> str:
    """Why an entry whose meta is `stored` is not loaded into a cache whose meta is `here`."""
    differ = sorted(key for key in stored.keys() | here.keys() if stored.get(key) != here.get(key))
    said = ", ".join(f"{key} {stored.get(key)} (here {here.get(key)})" for key in differ)
    if "tensor_parallel_size" in differ:
        return f"the entry was stored at another tensor-parallel size, not restored: {said}"
    return f"the entry was stored by an engine of another KV layout: {said}"
