"""The connector's worker half: copies whole blocks between the store's shared memory and
vLLM's paged KV cache, and writes the KV of recovered tokens into it. It never claims or
commits; see metadata.py.

Recovery runs KMesh's layerwise executor in the worker. vLLM hands a connector neither the model
nor, on CPU, usable weights (vllm/model_executor/layers/utils.py::dispatch_cpu_unquantized_gemm
prepacks every linear layer and leaves its `weight` empty), so the executor loads the same
model folder itself (a second copy of the weights) and computes in float32. Its rows are written
with vLLM's own cache-write op (`cpu_attn_reshape_and_cache`, with the attention layer's ISA), so
the page layout (on CPU, K transposed inside each block) is vLLM's by construction.
"""

import logging
import warnings
from typing import Any

import numpy as np
import torch

from kmesh.compute.executor import Executor, SequenceInput
from kmesh.compute.loader import load_model
from kmesh.store import StoreError, TenantClients
from kmesh.store.client import encode_meta, write_segment
from kmesh.vllm.layout import BlockLayout
from kmesh.vllm.metadata import (
    KMeshConnectorMetadata,
    KMeshWorkerMetadata,
    RecoverTokens,
    TenantKey,
)

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, store: str | None, layout: BlockLayout, model: str) -> None:
        self.store = store
        self.layout = layout
        self.model = model
        self._executor: Executor | None = None
        self.meta = layout.meta
        self.meta_bytes = encode_meta(layout.meta)
        self._layers: list[torch.Tensor] = []
        self._client = TenantClients(
            store or ""
        )  # without a store never used (it would be unavailable)
        self._load_errors: set[int] = set()
        self._saved: dict[TenantKey, int | None] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layers = [kv_caches[name] for name in self.layout.layer_names]
        first = self._layers[0]
        page = first[0]
        page_bytes = page.numel() * page.element_size()
        if (
            not page.is_contiguous()
            or page_bytes != self.layout.page_bytes
            or first.dtype != self.layout.dtype
        ):
            raise ValueError(
                f"vLLM's KV cache pages are not contiguous {self.layout.page_bytes}-byte blocks "
                f"of {self.layout.dtype} (shape {tuple(first.shape)}, strides {first.stride()}, "
                f"{first.dtype}); KMeshConnector copies whole pages"
            )

    def load(self, metadata: KMeshConnectorMetadata) -> None:
        """Fill the blocks the scheduler side found in the store (before the forward pass). A
        block that cannot be loaded is reported, and vLLM recomputes it."""
        for load in metadata.loads:
            try:
                with self._client(load.tenant).read(load.hit) as entry:
                    if entry.meta != self.meta:
                        raise StoreError(
                            f"entry layout {entry.meta} is not this cache's {self.meta}"
                        )
                    self._copy_in(load.block_id, entry.data)
            except StoreError as error:
                log.warning(
                    "kmesh: block %d not loaded, vLLM recomputes it: %s", load.block_id, error
                )
                self._load_errors.add(load.block_id)

    def recover(self, metadata: KMeshConnectorMetadata, attention_layers: dict[str, Any]) -> None:
        """Fill the claimed tokens of recovery requests (policy full) before the forward pass."""
        for job in metadata.recoveries:
            self._recover(job, attention_layers)

    def save(self, metadata: KMeshConnectorMetadata) -> None:
        """Copy the blocks computed this step into the segments the store reserved for them."""
        for save in metadata.saves:

            def write(target: memoryview, block_id: int = save.block_id) -> None:
                out = np.frombuffer(target, dtype=np.uint8)
                page = self.layout.page_bytes
                for i, layer in enumerate(self._layers):
                    out[i * page : (i + 1) * page] = _page_bytes(layer, block_id)

            try:
                crc = write_segment(
                    save.segment, save.key, self.layout.block_bytes, self.meta_bytes, write
                )
            except StoreError as error:
                log.warning("kmesh: block %d not saved: %s", save.block_id, error)
                crc = None
            self._saved[(save.tenant, save.key)] = crc

    def _recover(self, job: RecoverTokens, attention_layers: dict[str, Any]) -> None:
        from vllm import _custom_ops as ops

        if self.layout.platform != "cpu" or self.layout.dtype != torch.float32:
            raise ValueError(
                "KMesh recovery inside vLLM runs on CPU with a float32 KV cache only so far; "
                f"this engine is {self.layout.platform} / {self.layout.dtype}"
            )
        executor = self._executor_of_model()
        n = len(job.token_ids)
        with torch.inference_mode():
            out = executor.forward([SequenceInput(torch.tensor(job.token_ids), torch.arange(n))])[0]
        block = self.layout.block_size
        positions = torch.arange(job.start, n)
        table = torch.tensor(job.block_ids)
        slots = table[positions // block] * block + positions % block
        for index, (name, layer) in enumerate(
            zip(self.layout.layer_names, self._layers, strict=True)
        ):
            pages = layer.view(layer.shape[0], layer.shape[1], 2 * block, -1)
            key_cache, value_cache = pages.chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(
                out.k[index][job.start :].contiguous(),
                out.v[index][job.start :].contiguous(),
                key_cache,
                value_cache,
                slots,
                attention_layers[name].isa,
            )

    def _executor_of_model(self) -> Executor:
        if self._executor is None:
            self._executor = load_model(self.model).executor
        return self._executor

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_saved(self) -> KMeshWorkerMetadata | None:
        if not self._saved:
            return None
        saved, self._saved = self._saved, {}
        return KMeshWorkerMetadata(saved)

    def close(self) -> None:
        self._client.close()

    def _copy_in(self, block_id: int, data: memoryview) -> None:
        with warnings.catch_warnings():  # read-only shared memory: torch only reads from it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            source = torch.from_numpy(np.frombuffer(data, dtype=np.uint8))
        page = self.layout.page_bytes
        for i, layer in enumerate(self._layers):
            layer[block_id].view(-1).view(torch.uint8).copy_(source[i * page : (i + 1) * page])
        del source


def _page_bytes(layer: torch.Tensor, block_id: int) -> np.ndarray:
    return layer[block_id].reshape(-1).view(torch.uint8).cpu().numpy()
