"""Which page format an engine's KV pages are in (pages.py says what the formats are), read from
vLLM at start: the attention backend class of the model's layers and the KV cache layout the
engine core resolved. A backend not listed, a quantized cache, or a layout the backend does not
declare is refused in one line.
"""

from collections.abc import Sequence
from typing import Any

import torch

from kmesh.vllm.cpu_pages import CpuPages
from kmesh.vllm.pages import Pages
from kmesh.vllm.split_pages import SplitPages

# vLLM's attention backend name (AttentionBackend.get_name()) -> the page format KMesh reads.
PAGE_FORMATS = {
    "CPU_ATTN": "cpu",
    "FLASH_ATTN": "kv_split",
    "FLASHINFER": "kv_split",
    "TRITON_ATTN": "kv_split",
}
# What the page formats hold: float caches only (a quantized cache's bytes need its scales).
PAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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

    kind, layout = format_.split(":")
    if kind == "cpu":
        return CpuPages(layers, block_size, [attention_layers[name] for name in names])
    return SplitPages(layers, block_size, KVCacheLayout[layout].layer_view_order)
