"""The worker half's guards (kmesh/vllm/worker_side.py): it takes float KV caches (float32,
bfloat16, float16) and refuses a quantized one when vLLM registers it; recovery runs on one worker
with a model in the cache's dtype, and anything else is refused and the claimed blocks go back to
vLLM, which computes them."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kmesh.compute.tiny import tiny_executor
from kmesh.vllm.layout import BlockLayout
from kmesh.vllm.metadata import KMeshConnectorMetadata
from kmesh.vllm.worker_side import WorkerSide
from tests.vllm.helpers import cpu_attention

BLOCK = 4
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
PAGE_SHAPE = (2, BLOCK, 8)  # kv heads, block size, 2 * head size


def refused(recovery: object) -> None:
    raise AssertionError("a refused recovery must not run")


@pytest.mark.parametrize(
    ("cache", "model", "parallel", "reason"),
    [
        (torch.bfloat16, torch.float32, 1, "runs in torch.float32, the KV cache is torch.bfloat16"),
        (torch.float32, torch.float32, 2, "runs on one worker"),
    ],
    ids=["model in another dtype", "tensor parallel"],
)
def test_recovery_it_cannot_run_is_refused_and_the_blocks_go_back_to_vllm(
    cache, model, parallel, reason, caplog
):
    page_bytes = int(np.prod(PAGE_SHAPE)) * cache.itemsize
    layout = BlockLayout(LAYERS, BLOCK, page_bytes, cache, "cpu", tp_size=parallel)
    side = WorkerSide(None, layout)
    side.register_kv_caches(
        {name: torch.zeros(6, *PAGE_SHAPE, dtype=cache) for name in LAYERS}, cpu_attention(LAYERS)
    )
    executor, _ = tiny_executor(dtype=model)
    side.attach_recovery(SimpleNamespace(executor=executor, run=refused))
    job = SimpleNamespace(request_id="a", block_ids=[3, 4, 5], start=BLOCK, end=2 * BLOCK)
    side.recover(KMeshConnectorMetadata(recoveries=[job]))
    assert side.take_load_errors() == {4}  # block 1 of the request: rows [4, 8)
    assert reason in caplog.text


@pytest.mark.parametrize("cache", [torch.float16, torch.bfloat16, torch.float32])
def test_float_caches_are_taken(cache):
    page_bytes = int(np.prod(PAGE_SHAPE)) * cache.itemsize
    side = WorkerSide(None, BlockLayout(LAYERS, BLOCK, page_bytes, cache, "cpu"))
    layers = {name: torch.zeros(6, *PAGE_SHAPE, dtype=cache) for name in LAYERS}
    side.register_kv_caches(layers, cpu_attention(LAYERS))


def test_a_quantized_cache_is_refused_when_vllm_registers_it():
    layout = BlockLayout(LAYERS, BLOCK, int(np.prod(PAGE_SHAPE)), torch.uint8, "cpu")
    side = WorkerSide(None, layout)
    layers = {name: torch.zeros(6, *PAGE_SHAPE, dtype=torch.uint8) for name in LAYERS}
    with pytest.raises(ValueError, match="copies float KV caches") as raised:
        side.register_kv_caches(layers, cpu_attention(LAYERS))
    assert "\n" not in str(raised.value)
