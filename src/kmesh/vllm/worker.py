"""vLLM's worker with KMesh's recovery attached at startup: `worker_cls` (`--worker-cls
kmesh.vllm.worker.KMeshWorker`), so a plain `vllm serve` with KMeshConnector recovers without a
`collective_rpc` call (kmesh/vllm/worker_extension.py says what attaching does).

It is the platform's own worker (CPUWorker on CPU, the GPU Worker elsewhere) plus one override:
once vLLM has set up the KV cache and, with it, the connector
(vllm/v1/worker/gpu_worker.py::Worker.initialize_from_config), it attaches the loaded model to
KMeshConnector. With another connector, or none, or with tensor parallelism (recovery runs on one
worker so far: recovery_support.py), it is vLLM's worker unchanged.
"""

from typing import Any

from vllm.platforms import current_platform
from vllm.v1.worker.gpu_worker import Worker

from kmesh.vllm.worker_extension import KMeshWorkerExtension

PlatformWorker: type[Worker] = Worker
if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker

    PlatformWorker = CPUWorker


class KMeshWorker(PlatformWorker, KMeshWorkerExtension):  # type: ignore[misc,valid-type]
    def initialize_from_config(self, kv_cache_config: Any) -> None:
        super().initialize_from_config(kv_cache_config)
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if self.vllm_config.parallel_config.tensor_parallel_size != 1:
            return
        if has_kv_transfer_group() and hasattr(get_kv_transfer_group(), "attach_recovery"):
            self.kmesh_attach()
