"""Whether an engine can recover, from vLLM's config alone (kmesh/vllm/recovery_support.py)."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kmesh.vllm.layout import BlockLayout
from kmesh.vllm.recovery_support import recovery_unavailable
from kmesh.vllm.worker_extension import KMeshWorkerExtension

LAYOUT = BlockLayout(("model.layers.0.self_attn.attn",), 32, 4096, torch.float32, "cpu")
CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"  # what "auto" becomes on CPU


class OwnWorker(KMeshWorkerExtension):
    """A deployment's own worker class built on KMesh's extension."""


def parallel(worker_cls: str, worker_extension_cls: str = "") -> SimpleNamespace:
    return SimpleNamespace(worker_cls=worker_cls, worker_extension_cls=worker_extension_cls)


@pytest.mark.parametrize(
    "config",
    [
        parallel("kmesh.vllm.worker.KMeshWorker"),
        parallel(CPU_WORKER, "kmesh.vllm.worker_extension.KMeshWorkerExtension"),
        parallel(f"{__name__}.OwnWorker"),
        parallel("no_such_package.Worker"),  # not importable here: the worker half decides
    ],
)
def test_an_engine_with_kmeshs_worker_may_recover(config):
    assert recovery_unavailable(config, LAYOUT) is None


@pytest.mark.parametrize(
    "worker_cls",
    [CPU_WORKER, "auto", f"{__name__}.SimpleNamespace"],  # the last: importable, not KMesh's
)
def test_vllms_own_worker_cannot_recover_and_the_reason_names_the_flag(worker_cls):
    reason = recovery_unavailable(parallel(worker_cls), LAYOUT)
    assert reason is not None
    assert worker_cls in reason
    assert reason.endswith("start vLLM with --worker-cls kmesh.vllm.worker.KMeshWorker")


@pytest.mark.parametrize(
    ("change", "said"),
    [({"dtype": torch.uint8}, "is torch.uint8"), ({"tp_size": 2}, "this engine has 2")],
    ids=["a quantized cache", "tensor parallel"],
)
def test_an_engine_recovery_cannot_fill_is_named(change, said):
    reason = recovery_unavailable(
        parallel("kmesh.vllm.worker.KMeshWorker"), replace(LAYOUT, **change)
    )
    assert reason is not None and said in reason


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float_caches_on_any_platform_can_recover(dtype):
    layout = replace(LAYOUT, dtype=dtype, platform="cuda", page_format="kv_split:LBNHC")
    assert recovery_unavailable(parallel("kmesh.vllm.worker.KMeshWorker"), layout) is None
