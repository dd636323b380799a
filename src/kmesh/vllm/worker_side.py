"""The connector's worker half: copies whole blocks (its layers' pages in layer order; the bytes
moved by store/tensors.py) between the store's shared memory and vLLM's paged KV cache, fills the
rows of recovered tokens (kmesh/recovery/requests.py), keeps finished requests' generated rows
as output segments for later recoveries (`keep_output`; their blocks are freed once it has read
them), and keeps the page tails the scheduler half files, copying them into the requests that
claim them (tail_claims.py). It never claims or commits; see metadata.py.

Recovery runs KMesh's layerwise executor on vLLM's own loaded model. vLLM hands a connector no
model, so it is attached from outside: KMesh's worker class (kmesh/vllm/worker.py, vLLM's
`worker_cls`) passes the worker's model in at startup, through `kmesh_attach`
(kmesh/vllm/worker_extension.py). Without it, or when recovery fails, the claimed blocks are
reported as load errors and vLLM computes them itself. Recovery runs on the worker's device in
the KV cache's dtype, float32, bfloat16 or float16 (the engine's `dtype`).

Store entries cross through host staging (staging.py: pinned buffers and a side stream on a GPU);
with tensor parallelism an entry holds every worker's shard, gathered by the first rank
(shards.py). Pages are read and written in the engine's page format (pages.py), which must be
the one the scheduler half named in the entries' meta: a backend KMesh cannot read is refused
when the KV cache is registered, before vLLM serves.
"""

import logging
from typing import Any

import torch

from kmesh.kv.block_pool import blocks_for
from kmesh.recovery.jobs import RecoveredRows, RecoveryJob, RecoveryReport
from kmesh.recovery.requests import RequestRecovery
from kmesh.store import StoreError, TenantClients
from kmesh.store.segments import encode_meta, write_segment
from kmesh.store.shared.state import shared_through
from kmesh.store.tensors import segment_tensor, tensor_bytes
from kmesh.vllm.layout import BlockLayout, layout_mismatch
from kmesh.vllm.metadata import (
    CopyTail,
    KeepTail,
    KMeshConnectorMetadata,
    KMeshWorkerMetadata,
    TenantKey,
)
from kmesh.vllm.page_formats import page_format, pages_for
from kmesh.vllm.pages import Pages
from kmesh.vllm.shards import Shards
from kmesh.vllm.staging import Staging

log = logging.getLogger(__name__)

# KV cache dtypes recovery runs in (the executor computes in the cache's dtype).
RECOVERABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class WorkerSide:
    def __init__(
        self, store: str | None, layout: BlockLayout, shards: Shards | None = None
    ) -> None:
        self.store = store
        self.layout = layout
        self.shards = shards or Shards(0, 1, layout.rank_bytes)
        self._staging = Staging(torch.device("cpu"))
        self._recovery: RequestRecovery | None = None  # set by attach_recovery
        self._pages: Pages | None = None
        self.meta = layout.meta
        self.meta_bytes = encode_meta(layout.meta)
        self._layers: list[torch.Tensor] = []
        self._client = TenantClients(
            store or ""
        )  # without a store never used (it would be unavailable)
        self._load_errors: set[int] = set()
        self._saved: dict[TenantKey, int | None] = {}
        self._recovered: dict[str, RecoveryReport] = {}
        self._transcripts: dict[str, tuple[bytes, ...]] = {}
        self._kept: set[str] = set()  # requests whose output was read: their blocks may go
        self._tails: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # k, v of kept tails

    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], attention: dict[str, Any]
    ) -> None:
        """vLLM's per-layer KV views, and its attention modules by layer name (their backend
        decides the page format); ValueError in one line where KMesh cannot read the pages."""
        layout = self.layout
        self._layers = [kv_caches[name] for name in layout.layer_names]
        first = self._layers[0]
        backend = attention[layout.layer_names[0]].attn_backend
        found = page_format(backend, layout.kv_layout, first.dtype)
        if found != layout.page_format or first.dtype != layout.dtype:
            raise ValueError(
                f"vLLM's KV pages are {found} of {first.dtype}; the connector expected "
                f"{layout.page_format} of {layout.dtype} on {layout.platform}"
            )
        self._pages = pages_for(
            found, self._layers, layout.block_size, attention, layout.layer_names
        )
        self._staging = Staging(first.device)
        page = self._pages.page(0, 0)
        if page.numel() * page.element_size() != layout.page_bytes:
            raise ValueError(
                f"vLLM's KV pages are not {layout.page_bytes}-byte blocks (shape "
                f"{tuple(first.shape)}, strides {first.stride()}); KMeshConnector copies whole "
                "pages"
            )

    def load(self, metadata: KMeshConnectorMetadata) -> None:
        """Fill the blocks the scheduler side found in the store (before the forward pass). A
        block that cannot be loaded is reported, and vLLM recomputes it."""
        for load in metadata.loads:
            try:
                with self._client(load.tenant).read(load.hit) as entry:
                    if entry.meta != self.meta:
                        raise StoreError(layout_mismatch(entry.meta, self.meta))
                    self._copy_in(load.block_id, entry.data)
            except StoreError as error:
                log.warning(
                    "kmesh: block %d not loaded, vLLM recomputes it: %s", load.block_id, error
                )
                self._load_errors.add(load.block_id)
        self._staging.wait()  # before recovery or vLLM's forward pass reads the pages

    def keep_outputs(self, metadata: KMeshConnectorMetadata) -> None:
        """Read finished requests' generated rows (exact, from the pages their blocks still hold)
        into recovery's output segments. Without recovery attached there is nothing to keep them
        in; the blocks are released all the same."""
        for out in metadata.outputs:
            self._kept.add(out.request_id)
            if self._recovery is None or self._pages is None:
                continue
            try:
                positions = torch.arange(out.start, out.start + len(out.token_ids))
                k, v = self._pages.read(out.block_ids, positions)
                self._recovery.segments.keep_output(out.tenant, out.token_ids, k, v, out.start)
            except Exception as error:  # a kept output is an optimisation: never fatal
                log.warning("kmesh: output of %s not kept: %s", out.request_id, error)

    def keep_tails(self, keeps: list[KeepTail]) -> None:
        """Read page tails' rows from the requests' pages, exact in the cache's dtype. A tail
        whose pages had a load error this step is not kept (its rows would be wrong); a later
        copy of it then fails, and vLLM computes those rows."""
        for keep in keeps:
            written = keep.block_ids[: blocks_for(keep.end, self.layout.block_size)]
            if self._pages is None or not self._load_errors.isdisjoint(written):
                continue
            try:
                k, v = self._pages.read(keep.block_ids, torch.arange(keep.start, keep.end))
                self._tails[keep.tail_id] = (k.contiguous(), v.contiguous())  # not the pages read
            except Exception as error:  # a kept tail is an optimisation: never fatal
                log.warning("kmesh: page tail %d not kept: %s", keep.tail_id, error)

    def copy_tails(self, copies: list[CopyTail]) -> None:
        """Write kept tails' rows into the requests that claimed them (before the forward pass);
        a tail not held or not written is a load error: vLLM computes those blocks."""
        block = self.layout.block_size
        for copy in copies:
            rows = self._tails.get(copy.tail_id)
            try:
                if rows is None or self._pages is None:
                    raise KeyError(f"page tail {copy.tail_id} is not held")
                count = copy.end - copy.start
                k, v = rows[0][:, :count], rows[1][:, :count]
                positions = torch.arange(copy.start, copy.end)
                self._pages.write(copy.block_ids, positions, k, v)
            except Exception as error:
                log.warning("kmesh: page tail not copied, vLLM computes its rows: %s", error)
                self._load_errors.update(
                    copy.block_ids[copy.start // block : blocks_for(copy.end, block)]
                )

    def drop_tails(self, tail_ids: list[int]) -> None:
        for tail_id in tail_ids:
            self._tails.pop(tail_id, None)

    def take_kept(self) -> set[str]:
        """The requests whose output was read since the last call (each finished in the step
        before the one that read it, so vLLM has named it in a `get_finished` call)."""
        kept, self._kept = self._kept, set()
        return kept

    def attach_recovery(self, recovery: RequestRecovery) -> None:
        """Recovery on vLLM's model; with a store, what it shares goes through it
        (kmesh/store/shared/state.py)."""
        if self.store is not None:
            config = recovery.executor.config
            recovery.share(shared_through(self._client, recovery.fingerprint, config))
        self._recovery = recovery

    def recover(self, metadata: KMeshConnectorMetadata) -> None:
        """Fill the claimed rows of recovery requests before the forward pass. Whatever cannot
        be recovered (no model attached, the gate, an error) is reported as load errors: vLLM
        computes those blocks itself."""
        jobs = metadata.recoveries
        if not jobs:
            return
        pages = self._pages
        try:
            if self._recovery is None or pages is None:
                raise RuntimeError(
                    "no model attached for recovery: start vLLM with worker_cls "
                    "kmesh.vllm.worker.KMeshWorker (--worker-cls), or call "
                    "collective_rpc('kmesh_attach') after starting it"
                )
            self._check_recoverable(self._recovery.executor.dtype)
            unloaded = [job for job in jobs if self._prefix_unloaded(job)]
            for job in unloaded:  # its prefix did not load: its rows would be wrong
                self._give_back(job)
            jobs = [job for job in jobs if job not in unloaded]

            def write(job: RecoveryJob, outcome: RecoveredRows) -> None:
                self._recovered[job.request_id] = outcome.report
                if outcome.k is None or outcome.v is None:
                    self._give_back(job)
                    return
                positions = torch.arange(job.start, job.end)
                pages.write(job.block_ids, positions, outcome.k, outcome.v)

            for request_id, outcome in self._recovery.run(jobs, pages, write).items():
                if outcome.transcript:
                    self._transcripts[request_id] = outcome.transcript
        except Exception as error:  # recovery must never take the engine down: vLLM computes
            log.warning(
                "kmesh: recovery failed, vLLM computes the claimed tokens: %s", error, exc_info=True
            )
            for job in jobs:
                self._recovered.pop(job.request_id, None)
                self._give_back(job)

    def _prefix_unloaded(self, job: RecoveryJob) -> bool:
        """Whether a block of the job's prefix failed to load this step."""
        prefix = job.block_ids[: job.start // self.layout.block_size]
        return not self._load_errors.isdisjoint(prefix)

    def _check_recoverable(self, executor_dtype: torch.dtype) -> None:
        """Raise unless recovery can fill this engine's cache: a float32, bfloat16 or float16
        cache, one worker (recovery_support.py), and an executor in the cache's dtype (its KV
        is written as it is computed)."""
        layout = self.layout
        if layout.dtype not in RECOVERABLE_DTYPES or layout.tp_size != 1:
            raise RuntimeError(
                "recovery inside vLLM runs on one worker with a float KV cache; this engine "
                f"has {layout.tp_size} workers and a {layout.dtype} cache"
            )
        if executor_dtype != layout.dtype:
            raise RuntimeError(
                f"the attached model runs in {executor_dtype}, the KV cache is {layout.dtype}"
            )

    def save(self, metadata: KMeshConnectorMetadata) -> None:
        """Copy the blocks computed this step into the segments the store reserved for them;
        a block whose load or recovery failed this step is abandoned (vLLM recomputed it, and
        what it computed need not be what its key names: an activated request's base rows)."""
        pages = self._pages
        for save in metadata.saves:
            assert pages is not None, "a save before the KV cache was registered"
            mine = self._staging.to_host(
                [pages.page(layer, save.block_id) for layer in range(len(self._layers))]
            )
            parts = self.shards.gather(mine)  # every worker takes part, in the same order
            if not self.shards.writes:
                continue
            if save.block_id in self._load_errors:
                self._saved[(save.tenant, save.key)] = None
                continue
            try:
                crc = write_segment(
                    save.segment,
                    save.key,
                    self.layout.block_bytes,
                    self.meta_bytes,
                    tensor_bytes(parts),
                )
            except StoreError as error:
                log.warning("kmesh: block %d not saved: %s", save.block_id, error)
                crc = None
            self._saved[(save.tenant, save.key)] = crc

    def _give_back(self, job: RecoveryJob) -> None:
        """Report a job's claimed blocks as not loaded: vLLM's prefill computes them."""
        block = self.layout.block_size
        self._load_errors.update(job.block_ids[job.start // block : blocks_for(job.end, block)])

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_worker_meta(self) -> KMeshWorkerMetadata | None:
        if not self._saved and not self._recovered and not self._transcripts:
            return None
        meta = KMeshWorkerMetadata(self._saved, self._recovered, self._transcripts)
        self._saved, self._recovered, self._transcripts = {}, {}, {}
        return meta

    def close(self) -> None:
        self._client.close()

    def _copy_in(self, block_id: int, data: memoryview) -> None:
        """This worker's pages of a block, layer after layer, from shared memory into vLLM's
        cache (through host staging on a GPU)."""
        assert self._pages is not None, "a load before the KV cache was registered"
        source = self.shards.mine(segment_tensor(data))
        pages = [self._pages.page(layer, block_id) for layer in range(len(self._layers))]
        self._staging.to_pages(source, pages)
        del source
