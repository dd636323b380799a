"""vLLM worker methods that hand the worker's loaded model to KMeshConnector's worker half.

vLLM gives a KV connector its KV cache tensors but never the model. `kmesh_attach` builds KMesh's
layerwise executor over the worker's model modules (kmesh/vllm/model_bridge.py: the same weights,
no second copy; a model that differs from its config.json's description is refused there, so
vLLM does not start) and gives it to the connector, whose recovery then runs inside the worker.
KMeshWorker (kmesh/vllm/worker.py) calls it at startup; as vLLM's `worker_extension_cls` it can
also be mixed into another worker class (appended to its bases: it adds methods, it cannot
override them, vllm/v1/worker/worker_base.py::WorkerWrapperBase.init_worker) and called through
`collective_rpc("kmesh_attach")`.
"""

import json
from pathlib import Path
from typing import Any

from kmesh.compute.config import ModelConfig
from kmesh.compute.fingerprint import model_fingerprint
from kmesh.recovery.requests import DEFAULT_RECOVERY_BYTES, RequestRecovery
from kmesh.vllm.config import extra_count
from kmesh.vllm.model_bridge import executor_of_vllm_model


class KMeshWorkerExtension:
    model_runner: Any  # vLLM's worker attribute
    vllm_config: Any

    def kmesh_attach(self) -> int:
        """Attach the worker's model to KMeshConnector; returns the layers the executor runs."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            raise RuntimeError("kmesh_attach needs the engine started with KMeshConnector")
        parallel = self.vllm_config.parallel_config.tensor_parallel_size
        if parallel != 1:
            raise RuntimeError(
                f"recovery runs on one worker so far; this engine has {parallel} "
                "(tensor_parallel_size)"
            )
        connector = get_kv_transfer_group()
        attach = getattr(connector, "attach_recovery", None)
        if attach is None:
            raise RuntimeError(
                f"the engine's KV connector is {type(connector).__name__}, not KMesh's"
            )
        path = self.vllm_config.model_config.model
        config = ModelConfig.from_hf(json.loads((Path(path) / "config.json").read_text()))
        executor = executor_of_vllm_model(self.model_runner.get_model(), config)
        transfer = self.vllm_config.kv_transfer_config
        limit = extra_count(transfer, "recovery_bytes", DEFAULT_RECOVERY_BYTES)
        page = self.vllm_config.cache_config.block_size
        attach(RequestRecovery(executor, model_fingerprint(path), limit, page_size=page))
        return config.num_layers
