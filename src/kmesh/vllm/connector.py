"""KMeshConnector: KMesh's keyed-state store inside vLLM 0.32, through the KV connector API.

Load it with `kv_transfer_config={"kv_connector": "KMeshConnector", "kv_connector_module_path":
"kmesh.vllm.connector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
"kv_connector_extra_config": {"store": "/path/to/store.sock"}}` (kmesh.vllm.config builds it),
or by name alone once kmesh is installed (the `vllm.general_plugins` entry point registers it).
Its construction refuses a vLLM release it was not tested with (kmesh/vllm/version.py), and sets
`kv_load_failure_policy` to "recompute" where it is "fail" (vLLM's default, which a connector
configured by name gets), saying so once: every block KMesh cannot load (a gate's fallback, a
checksum failure, an entry evicted meanwhile) is then computed by vLLM, never a failed request.
vLLM makes one instance per role: the scheduler role (scheduler_side.py, with tracked.py: keys;
store_side.py: store traffic and families; recovery_claims.py; stats) and the worker role
(worker_side.py: block copies; recovered rows from recovery.py, on the model the worker extension
attaches: worker_extension.py).
With a store, the scheduler role has it make as many segments of a block's size as vLLM's KV
cache has blocks (`prefault_blocks` in the extra config; 0: none) and faults them in at start, as
vLLM touches its own KV cache, so that publishing writes memory already there (store/tier.py).
The worker role likewise writes a heap reserve once when the KV cache is registered
(`heap_reserve_bytes`; default half the cache, or none where the engine cannot recover; 0: none;
heap_reserve.py), so that recovery's buffers reuse memory the process holds.
Without a store it only reports per-request stats (and recovers, if asked). Recovery needs
`--worker-cls kmesh.vllm.worker.KMeshWorker`: without it the scheduler role warns once at start
and refuses every recovery, saying why (recovery_support.py). Each finished
request's output carries `kv_transfer_params["kmesh"]` = {prompt_tokens, reused_tokens,
restored_tokens, recovered_tokens, computed_tokens, family, `recovery` when asked, and
`kept_output_tokens` when it kept its output (its blocks are then freed a step later, once the
worker half has read its generated rows)}; `reused_tokens` counts vLLM's prefix-cache hit and the
rows copied from a page tail an earlier request of this engine left (tail_claims.py), those also
as `page_tail_tokens` when there are any. The same counts, summed, reach vLLM's /metrics
(metrics.py).
"""

import logging
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.platforms import current_platform

from kmesh.recovery.requests import RequestRecovery
from kmesh.state.request_meta import KMESH_PARAMS_KEY
from kmesh.vllm import heap_reserve
from kmesh.vllm.config import extra_count
from kmesh.vllm.layout import BlockLayout
from kmesh.vllm.metadata import KMeshConnectorMetadata, KMeshWorkerMetadata
from kmesh.vllm.metrics import KMeshConnectorStats, KMeshPromMetrics, finished_counts
from kmesh.vllm.recovery_support import recovery_unavailable
from kmesh.vllm.scheduler_side import SchedulerSide
from kmesh.vllm.shards import Shards
from kmesh.vllm.version import check_vllm_version
from kmesh.vllm.worker_side import WorkerSide

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KMeshConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"
    ) -> None:
        check_vllm_version(vllm.__version__)  # before anything of vLLM's is relied on
        super().__init__(vllm_config, role, kv_cache_config)
        store = self._kv_transfer_config.get_from_extra_config("store", None)
        layout = engine_layout(vllm_config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            recompute_failed_loads(self._kv_transfer_config)
            unavailable = recovery_unavailable(vllm_config.parallel_config, layout)
            model = vllm_config.model_config.model
            # A finished request's page tail is read from its freed block in the next step, if
            # that step left the block free: only when steps run one after another.
            finished_tails = not vllm_config.scheduler_config.async_scheduling
            transfer = self._kv_transfer_config
            prefault = extra_count(transfer, "prefault_blocks", kv_cache_config.num_blocks)
            self._scheduler = SchedulerSide(
                store, layout, model, unavailable, finished_tails, prefault
            )
            self._scheduler.warm()
        else:
            self._worker = WorkerSide(store, layout, Shards.of_engine(layout.rank_bytes))
            self._attention = vllm_config.compilation_config.static_forward_context
            self._heap_reserve = heap_reserve_setting(
                self._kv_transfer_config, vllm_config.parallel_config, layout
            )

    # -- worker role ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side.register_kv_caches(kv_caches, self._attention)
        reserve = self._heap_reserve
        if reserve is None:
            cache_bytes = sum(layer.nbytes for layer in kv_caches.values())
            reserve = heap_reserve.default_reserve(cache_bytes)
        heap_reserve.warm(reserve)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        worker, metadata = self._worker_side, self._metadata
        # Before this step's copies read them (their freed blocks are free all this step).
        worker.keep_tails(metadata.finished_tails)
        worker.keep_outputs(metadata)  # before this step's recoveries read them
        worker.copy_tails(metadata.tail_copies)
        worker.load(metadata)
        worker.recover(metadata)

    def attach_recovery(self, recovery: RequestRecovery) -> None:
        """Called by the worker extension (kmesh_attach) with an executor on vLLM's model."""
        self._worker_side.attach_recovery(recovery)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, done in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks are saved after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        worker, metadata = self._worker_side, self._metadata
        worker.save(metadata)
        worker.keep_tails(metadata.prompt_tails)  # the rows this step computed
        worker.drop_tails(metadata.dropped_tails)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose kept output the worker has read: vLLM frees their blocks now."""
        return self._worker_side.take_kept(), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side.take_load_errors()

    def build_connector_worker_meta(self) -> KMeshWorkerMetadata | None:
        return self._worker_side.take_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- scheduler role ------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler_side.bind_block_ids(kv_cache_manager.get_block_ids)
        pool = kv_cache_manager.block_pool
        self._scheduler_side.tails.bind_block_pool(
            lambda block_id: pool.blocks[block_id].ref_cnt == 0
        )

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        self._scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        side = self._scheduler_side
        if connector_output.invalid_block_ids:
            side.load_failed(connector_output.invalid_block_ids)
        worker_meta = connector_output.kv_connector_worker_meta
        reports = {}
        if isinstance(worker_meta, KMeshWorkerMetadata):
            side.update_connector_output(worker_meta.saved)
            side.pin_transcripts(worker_meta.transcripts)
            reports = worker_meta.recovered
        side.recovery_reports(reports)

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay_free, stats = self._scheduler_side.request_finished(request, block_ids)
        return delay_free, {KMESH_PARAMS_KEY: stats}

    def reset_cache(self) -> bool:
        """vLLM's `reset_prefix_cache(reset_connector=True)`: the page tails go (they extend
        this engine's prefix cache below the page); the store is shared and stays."""
        self._scheduler_side.tails.clear()
        return True

    # -- metrics (kmesh/vllm/metrics.py) -------------------------------------------------

    def get_kv_connector_stats(self) -> KMeshConnectorStats | None:
        """The scheduler side's requests finished since the last call (the worker has none)."""
        if self._scheduler is None:
            return None
        finished = self._scheduler.take_finished()
        return KMeshConnectorStats(finished_counts(finished)) if finished else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KMeshConnectorStats | None:
        return KMeshConnectorStats(data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KMeshPromMetrics:
        return KMeshPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- helpers -------------------------------------------------------------------------

    @property
    def _metadata(self) -> KMeshConnectorMetadata:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KMeshConnectorMetadata)
        return metadata

    @property
    def _scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-role call on the worker connector"
        return self._scheduler

    @property
    def _worker_side(self) -> WorkerSide:
        assert self._worker is not None, "a worker-role call on the scheduler connector"
        return self._worker


def heap_reserve_setting(transfer: Any, parallel_config: Any, layout: BlockLayout) -> int | None:
    """The worker's heap reserve in bytes from vLLM's KVTransferConfig: `heap_reserve_bytes` when
    given; else 0 where this engine cannot recover (the reserve is for recovery's buffers:
    recovery_support.py), None (heap_reserve.default_reserve, once the KV cache is allocated)
    where it can."""
    if transfer.get_from_extra_config("heap_reserve_bytes", None) is not None:
        return extra_count(transfer, "heap_reserve_bytes", 0)
    return 0 if recovery_unavailable(parallel_config, layout) is not None else None


def engine_layout(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> BlockLayout:
    """The stored block's layout of this engine: its KV cache groups, block size, platform, the
    KV cache layout the engine core resolved, and its tensor-parallel size."""
    kv_layout = getattr(kv_cache_config, "kv_cache_layout", None)
    if kv_layout is None:
        kv_layout = vllm_config.cache_config.get_resolved_kv_cache_layout().name
    return BlockLayout.of(
        kv_cache_config,
        vllm_config.cache_config.block_size,
        current_platform.device_type,
        kv_layout,
        vllm_config.parallel_config.tensor_parallel_size,
    )


def recompute_failed_loads(transfer: Any) -> None:
    """Set vLLM's kv_load_failure_policy (`transfer`: its KVTransferConfig) to "recompute"; the
    scheduler reads it after making its connector. With "fail", a block KMesh reports it could
    not load ends its request with an error instead of being computed."""
    if transfer.kv_load_failure_policy != "recompute":
        log.warning(
            "KMeshConnector: kv_load_failure_policy %r would fail a request whenever a block "
            "KMesh offered cannot be loaded (a gate's fallback, a checksum failure, an evicted "
            "entry); set to 'recompute': vLLM computes such blocks",
            transfer.kv_load_failure_policy,
        )
        transfer.kv_load_failure_policy = "recompute"
