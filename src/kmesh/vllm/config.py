"""How to start vLLM with KMeshConnector (offline `vllm.LLM(**kwargs)` or `AsyncEngineArgs`).

CPU defaults (docs/design/performance.md): eager mode (start ~40 s instead of ~125 s on 2 cores), an
explicit KV cache size, float32 by default (the reference engine's dtype, so the two engines can be
compared token for token; `dtype="bfloat16"` gives what vLLM's own "auto" picks on a CPU with
bfloat16, for this float32 model folder too, and recovery runs in it as well). A failed load from
the store is recomputed, never fatal.
"""

import json
from pathlib import Path
from typing import Any

from kmesh.compute.config import DTYPES, ModelConfig
from kmesh.compute.context import Context, resolve_context, vllm_cache_tokens
from kmesh.compute.loader import resolve_model_dir
from kmesh.compute.support import require
from kmesh.errors import InvalidRequestError

CONNECTOR_NAME = "KMeshConnector"
CONNECTOR_MODULE = "kmesh.vllm.connector"
DEFAULT_KV_CACHE_BYTES = 1 << 30
# The model's and the KV cache's dtype (the module docstring says why float32).
DEFAULT_DTYPE = "float32"
# vLLM's page size in tokens on CPU (a multiple of 32; vLLM's own default is 128). See
# docs/design/vllm-integration.md for the measurement that chose it.
DEFAULT_BLOCK_SIZE = 32
# vLLM's worker_cls: the platform's worker, attaching recovery at startup (kmesh/vllm/worker.py).
WORKER = "kmesh.vllm.worker.KMeshWorker"
# glibc's allocator for vLLM's processes (read when a process starts): every allocation from the
# heap (no mmap: glibc maps anything above 32 MiB whatever its threshold is set to, and a mapped
# buffer's pages fault again on every use), up to 16 GiB of freed memory kept for reuse (above any
# worker's heap reserve, kmesh/vllm/heap_reserve.py; 1 GiB until stop 53). Recovery makes many
# short-lived tensors of a few MiB to a few hundred (a region's KV at 32 agents: 56 MiB a tensor).
# The heap grows to the worker's peak once and is reused after; it is not returned to the system
# below that peak while the server runs. Measured on the agents bench's round (16 siblings, 15
# mirrored), with the threshold at 32 MiB: 6.6 s -> 4.2 s; no mmap at all (32 agents, round 2's
# siblings, docs/design/performance.md): 13.1 -> 8.2 s. Vanilla vLLM's servers in the benches get
# the same (kmesh/serve/process.py).
ALLOCATOR_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(16 << 30),
    "MALLOC_TOP_PAD_": str(256 << 20),
    "MALLOC_MMAP_MAX_": "0",
}


def kv_transfer_config(
    store: str | None, recovery_bytes: int | None = None, heap_reserve_bytes: int | None = None
) -> dict[str, Any]:
    """The `kv_transfer_config` that loads KMeshConnector. Without a store the connector only
    reports per-request stats (reused / computed tokens); `recovery_bytes`: what its worker
    keeps for recovery at most; `heap_reserve_bytes`: its worker's heap reserve
    (kmesh/vllm/heap_reserve.py; None: their defaults)."""
    extra: dict[str, Any] = {"store": store}
    if recovery_bytes is not None:
        extra["recovery_bytes"] = recovery_bytes
    if heap_reserve_bytes is not None:
        extra["heap_reserve_bytes"] = heap_reserve_bytes
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def extra_count(transfer: Any, name: str, default: int) -> int:
    """A whole number >= 0 from KMeshConnector's `kv_connector_extra_config` (vLLM's
    KVTransferConfig `transfer`), `default` when absent; ValueError naming it otherwise."""
    value = transfer.get_from_extra_config(name, default)
    if isinstance(value, bool) or not isinstance(value, int | str):
        value = repr(value)
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(
            f"kv_connector_extra_config {name!r} must be a whole number >= 0, not {value!r}"
        )
    return count


def vllm_engine_kwargs(
    model: str | Path | None = None,
    *,
    store: str | None = None,
    recovery_bytes: int | None = None,
    heap_reserve_bytes: int | None = None,
    connector: bool = True,
    max_model_len: int | None = None,
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    dtype: str = DEFAULT_DTYPE,
    block_size: int = DEFAULT_BLOCK_SIZE,
    tensor_parallel_size: int = 1,
    **overrides: Any,
) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` / `AsyncEngineArgs` on the given model folder (the
    embedded model when None). `connector=False` gives vanilla vLLM with the same settings.
    `dtype` is the model's and the KV cache's (recovery runs in "float32" or "bfloat16");
    `block_size` vLLM's page size in tokens (its CPU backend takes multiples of 32);
    `tensor_parallel_size` its workers, each with a shard of the heads (check_tensor_parallel);
    `max_model_len` the context (None: the model's, bounded by the KV cache: vllm_context).
    Whatever vLLM or the connector would refuse on this model and these settings is refused
    here, in one line (InvalidRequestError, ModelNotSupportedError), before vLLM starts."""
    if dtype not in DTYPES:
        raise InvalidRequestError(f"the dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if block_size < 32 or block_size % 32:
        raise InvalidRequestError(
            f"vLLM's CPU backend needs a block size that is a multiple of 32, got {block_size}"
        )
    folder = resolve_model_dir(model)
    config = ModelConfig.from_folder(folder)
    if connector:
        require(config, "KMeshConnector in vLLM")
    if connector or tensor_parallel_size != 1:
        check_tensor_parallel(config, folder.name, tensor_parallel_size)
    context = vllm_context(
        config,
        max_model_len=max_model_len,
        kv_cache_bytes=kv_cache_bytes,
        dtype=dtype,
        block_size=block_size,
        tensor_parallel_size=tensor_parallel_size,
    )
    kwargs: dict[str, Any] = {
        "model": str(folder),
        "dtype": dtype,
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "max_model_len": context.tokens,
        "kv_cache_memory_bytes": kv_cache_bytes,
        "block_size": block_size,
        "seed": 0,
    }
    if tensor_parallel_size != 1:
        kwargs["tensor_parallel_size"] = tensor_parallel_size
    if connector:
        kwargs["kv_transfer_config"] = kv_transfer_config(store, recovery_bytes, heap_reserve_bytes)
        kwargs["worker_cls"] = WORKER
    kwargs.update(overrides)
    return kwargs


def vllm_context(
    config: ModelConfig,
    *,
    max_model_len: int | None = None,
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    dtype: str = DEFAULT_DTYPE,
    block_size: int = DEFAULT_BLOCK_SIZE,
    tensor_parallel_size: int = 1,
) -> Context:
    """The context a vLLM engine with these settings starts with (kmesh/compute/context.py):
    `max_model_len` when given and it fits, else the model's bounded by what the KV cache holds,
    in whole pages, on each worker."""
    cache = vllm_cache_tokens(config, dtype, block_size, kv_cache_bytes, tensor_parallel_size)
    return resolve_context(config, max_model_len, cache)


def workload_context(config: ModelConfig, needed: int, least: int = 4096) -> int:
    """A bench's context: what its workload `needed`, and at least `least` tokens (runs of one bench
    compare at one setting) where the model's context has room; a workload longer than the
    model's is refused by vllm_context."""
    return max(needed, min(least, config.max_position))


def check_tensor_parallel(config: ModelConfig, name: str, workers: int) -> None:
    """InvalidRequestError, in one line, unless `workers` tensor-parallel workers can split the
    model: each takes a whole share of the query heads, and of the KV heads (or, where there are
    fewer KV heads than workers, vLLM gives each worker a copy of one)."""
    if workers < 1:
        raise InvalidRequestError(f"--tensor-parallel-size must be 1 or more, got {workers}")
    heads, kv_heads = config.num_heads, config.num_kv_heads
    splits = kv_heads % workers == 0 if kv_heads >= workers else workers % kv_heads == 0
    if heads % workers or not splits:
        raise InvalidRequestError(
            f"{name} has {heads} attention heads and {kv_heads} KV heads, which "
            f"{workers} tensor-parallel workers cannot split evenly: pick a size that divides "
            "them"
        )


def cpu_thread_binding(workers: int, cores: int | None = None) -> str:
    """vLLM's CPU backend's VLLM_CPU_OMP_THREADS_BIND for `workers` tensor-parallel workers: the
    cores this process may use, split into as many shares ("0|1", "0,1,2,3|4,5,6,7"); without
    it, vLLM refuses to bind more than one worker's threads. InvalidRequestError when there are
    fewer cores than workers."""
    import os

    available = sorted(os.sched_getaffinity(0)) if cores is None else list(range(cores))
    if len(available) < workers:
        raise InvalidRequestError(
            f"{workers} tensor-parallel workers on vLLM's CPU backend need a core each; this "
            f"process may use {len(available)}"
        )
    share = len(available) // workers
    shares = [available[worker * share : (worker + 1) * share] for worker in range(workers)]
    return "|".join(",".join(str(core) for core in mine) for mine in shares)


def vllm_server_args(kwargs: dict[str, Any]) -> list[str]:
    """`vllm_engine_kwargs` as the command line of vLLM's OpenAI server
    (`python -m vllm.entrypoints.openai.api_server ARGS`): `--flag` / `--no-flag` for booleans
    (vLLM's boolean options take both), JSON for dicts, None left out."""
    args: list[str] = []
    for name, value in kwargs.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            args.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            args += [f"--{flag}", json.dumps(value) if isinstance(value, dict) else str(value)]
    return args
