"""The worker half's guard on recovery (kmesh/vllm/worker_side.py): it runs in a float32 or
bfloat16 KV cache, with a model in the cache's dtype; anything else is refused and the claimed
blocks go back to vLLM, which computes them."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kmesh.compute.tiny import tiny_executor
from kmesh.vllm.layout import BlockLayout
from kmesh.vllm.metadata import KMeshConnectorMetadata
from kmesh.vllm.worker_side import WorkerSide

BLOCK = 4
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
PAGE_SHAPE = (2, BLOCK, 8)  # kv heads, block size, 2 * head size


def refused(recovery: object) -> None:
    raise AssertionError("a refused recovery must not run")


@pytest.mark.parametrize(
    ("cache", "model", "reason"),
    [
        (torch.float16, torch.float16, "float32 or bfloat16 KV cache only"),
        (torch.bfloat16, torch.float32, "runs in torch.float32, the KV cache is torch.bfloat16"),
    ],
)
def test_recovery_outside_its_dtypes_is_refused_and_the_blocks_go_back_to_vllm(
    cache, model, reason, caplog
):
    layout = BlockLayout(LAYERS, BLOCK, int(np.prod(PAGE_SHAPE)) * cache.itemsize, cache, "cpu")
    side = WorkerSide(None, layout)
    side.register_kv_caches({name: torch.zeros(6, *PAGE_SHAPE, dtype=cache) for name in LAYERS})
    executor, _ = tiny_executor(dtype=model)
    side.attach_recovery(SimpleNamespace(executor=executor, run=refused))
    job = SimpleNamespace(request_id="a", block_ids=[3, 4, 5], start=BLOCK, end=2 * BLOCK)
    side.recover(KMeshConnectorMetadata(recoveries=[job]), attention_layers={})
    assert side.take_load_errors() == {4}  # block 1 of the request: rows [4, 8)
    assert reason in caplog.text
