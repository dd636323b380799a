"""vLLM's GPU attention pages (kmesh/vllm/split_pages.py, format `kv_split`) in every KV cache
layout vLLM 0.32 describes, on CPU tensors: the per-layer views are made by vLLM's own
`create_kv_cache_views` over one backing allocation, as its GPU worker makes them; rows written
land where the backends' kernels read them (`kv_cache.transpose(1, 2).split(head_size, -1)`), and
a page's bytes, taken and put back, are byte-identical. The page format is read from vLLM's
backend classes (kmesh/vllm/pages.py), and anything else is refused in one line."""

import pytest
import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kmesh.vllm.page_formats import page_format
from kmesh.vllm.split_pages import SplitPages
from kmesh.vllm.staging import Staging
from tests import kv_layouts

BLOCK, HEADS, DIM, BLOCKS, LAYERS = 16, 2, 8, 5, 3
LAYOUTS = [layout.name for layout in KVCacheLayout]


def vllm_views(layout: str, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Per-layer [blocks, heads, block, 2 * head] views as vLLM's worker allocates them."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=dtype)
    kv_layout = KVCacheLayout[layout]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, kv_layout)
    size = spec.page_size_bytes * BLOCKS * LAYERS
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    tensor = KVCacheTensor(size, names, layer_stride, block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, BLOCKS, kv_layout, tensor)


def rows(n: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(LAYERS, n, HEADS, DIM).to(dtype), torch.randn(LAYERS, n, HEADS, DIM).to(
        dtype
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_land_where_the_backends_kernels_read_them(layout, dtype):
    views = vllm_views(layout, dtype)
    pages = SplitPages(views, BLOCK, KVCacheLayout[layout].layer_view_order)
    block_ids = [4, 0, 2]
    positions = torch.tensor([0, 1, 15, 16, 30, 33, 47])
    k, v = rows(len(positions), dtype)
    pages.write(block_ids, positions, k, v)
    for layer, view in enumerate(views):
        key_cache, value_cache = view.transpose(1, 2).split(DIM, dim=-1)  # FLASH_ATTN's reading
        for i, position in enumerate(positions.tolist()):
            block, offset = block_ids[position // BLOCK], position % BLOCK
            assert torch.equal(key_cache[block, offset], k[layer, i])
            assert torch.equal(value_cache[block, offset], v[layer, i])
    got_k, got_v = pages.read(block_ids, positions)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    untouched_k, untouched_v = pages.read(block_ids, torch.tensor([2, 17, 46]))
    assert not untouched_k.any() and not untouched_v.any()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_page_taken_and_put_back_is_byte_identical_and_in_memory_order(layout):
    source = vllm_views(layout)
    for view in source:
        view.copy_(torch.randn(view.shape))
    taken = SplitPages(source, BLOCK, KVCacheLayout[layout].layer_view_order)
    target = vllm_views(layout)
    put = SplitPages(target, BLOCK, KVCacheLayout[layout].layer_view_order)
    staging = Staging(torch.device("cpu"))
    data = staging.to_host([taken.page(layer, 3) for layer in range(LAYERS)])
    staging.to_pages(data, [put.page(layer, 1) for layer in range(LAYERS)])
    staging.wait()
    for src, dst in zip(source, target, strict=True):
        assert torch.equal(src[3], dst[1]) and not dst[0].any() and not dst[2].any()
    page = taken.page(0, 3)  # a block-compact layout's page is one run of memory, in order
    assert page.is_contiguous() == KVCacheLayout[layout].is_block_compact
    assert page.data_ptr() == source[0][3].data_ptr()


def test_the_torch_only_layouts_of_the_gpu_check_are_vllms():
    assert {layout.name: layout.value for layout in KVCacheLayout} == kv_layouts.LAYOUTS
    for layout in LAYOUTS:
        ours = kv_layouts.layer_views(layout, (LAYERS, BLOCKS, HEADS, BLOCK, 2 * DIM))
        for mine, theirs in zip(ours, vllm_views(layout), strict=True):
            assert mine.shape == theirs.shape and mine.stride() == theirs.stride()


@pytest.mark.parametrize(
    ("backend", "layout", "said"),
    [
        (CPUAttentionBackend, "LBHNC", "cpu:LBHNC"),
        (FlashAttentionBackend, "LBNHC", "kv_split:LBNHC"),
        (TritonAttentionBackend, "BHLNC", "kv_split:BHLNC"),
    ],
)
def test_the_page_format_is_read_from_vllms_backend(backend, layout, said):
    assert page_format(backend, layout, torch.bfloat16) == said


class _Flex:
    @staticmethod
    def get_name() -> str:
        return "FLEX_ATTENTION"

    @staticmethod
    def supported_kv_cache_layouts() -> None:
        return None


@pytest.mark.parametrize(
    ("backend", "layout", "dtype", "said"),
    [
        (_Flex, "LBNHC", torch.float32, "this engine runs FLEX_ATTENTION"),
        (CPUAttentionBackend, "LBNHC", torch.float32, "which CPU_ATTN does not declare (LBHNC)"),
        (FlashAttentionBackend, "LBNHC", torch.uint8, "this engine's is torch.uint8"),
    ],
    ids=["another backend", "an undeclared layout", "a quantized cache"],
)
def test_what_kmesh_cannot_read_is_refused_in_one_line(backend, layout, dtype, said):
    with pytest.raises(ValueError) as raised:
        page_format(backend, layout, dtype)
    assert said in str(raised.value) and "\n" not in str(raised.value)
