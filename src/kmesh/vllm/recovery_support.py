"""Whether this vLLM engine can recover at all, read from its config by the connector's scheduler
half at construction (the two halves share nothing else before the first step).

Recovery runs KMesh's executor on the worker's model, which vLLM never hands a connector: KMesh's
worker class hands it over at start (`--worker-cls kmesh.vllm.worker.KMeshWorker`,
kmesh/vllm/worker.py), or a `collective_rpc("kmesh_attach")` call does on a worker extended with
KMeshWorkerExtension (`--worker-extension-cls`; whether that call came, the scheduler half cannot
know). It fills a float32, bfloat16 or float16 KV cache on one worker: with tensor parallelism each
worker holds a shard of the heads, and recovery does not run per shard yet. An engine that cannot
recover refuses every recovery up front: vLLM computes the request exactly, and its stats say
why (`"recovery": {"refused": ...}`).
"""

import logging
from typing import Any

from kmesh.vllm.config import WORKER
from kmesh.vllm.layout import BlockLayout
from kmesh.vllm.worker_side import RECOVERABLE_DTYPES

log = logging.getLogger(__name__)

EXTENSION = "kmesh.vllm.worker_extension.KMeshWorkerExtension"


def recovery_unavailable(parallel_config: Any, layout: BlockLayout) -> str | None:
    """Why no recovery can run in this engine, given vLLM's ParallelConfig (its worker_cls and
    worker_extension_cls) and the KV cache's layout; None when it can (or may, once
    kmesh_attach is called)."""
    if layout.dtype not in RECOVERABLE_DTYPES:
        return (
            "recovery inside vLLM fills a float32, bfloat16 or float16 KV cache; this engine's "
            f"is {layout.dtype}: run it without --kv-cache-dtype"
        )
    if layout.tp_size != 1:
        return (
            f"recovery inside vLLM runs on one worker so far; this engine has "
            f"{layout.tp_size} (tensor_parallel_size): its requests are computed by vLLM, with "
            "exact sharing and restore on"
        )
    worker = str(parallel_config.worker_cls)
    extension = str(parallel_config.worker_extension_cls or "")
    if _gives_the_model(worker) is not False or _gives_the_model(extension) is not False:
        return None
    return (
        f"this vLLM runs vLLM's worker ({worker}), which gives KMeshConnector no model to "
        f"recover with: start vLLM with --worker-cls {WORKER}"
    )


def _gives_the_model(qualname: str) -> bool | None:
    """Whether a worker_cls or worker_extension_cls is (or derives from) KMesh's worker
    extension; None when its class cannot be imported here (then the worker half decides)."""
    if qualname in (WORKER, EXTENSION):
        return True
    if not qualname or qualname == "auto" or qualname.startswith("vllm."):
        return False
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from kmesh.vllm.worker_extension import KMeshWorkerExtension

    try:
        cls = resolve_obj_by_qualname(qualname)
    except Exception as error:  # the worker imports it, or fails to start, not this process
        log.info(
            "kmesh: %s not imported here (%s): recovery is left to the worker", qualname, error
        )
        return None
    return isinstance(cls, type) and issubclass(cls, KMeshWorkerExtension)
