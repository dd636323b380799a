"""KMesh through vLLM in `kmesh bench capacity` (kmesh_vllm, kmesh_vllm_lru): one agent count's
vanilla trace replayed by bench/capacity/vllm.py::replay in its own process, on a store this module
starts and stops: vLLM's KV cache holds one request of max_model_len (the least it starts with), the
store the rest of the budget (bench/capacity/sizing.py). The same requests on an unbounded store
(run once per agent count) give what nothing lost costs; the excess is what the store's losses cost.
"""

from pathlib import Path
from typing import Any

from kmesh.bench.capacity.process import run_vllm_process
from kmesh.bench.capacity.sizing import EngineSizing

# KMesh through vLLM (All-Gather) -> (members declare their next use, store retention)
KMESH_VLLM_STRATEGIES = {"kmesh_vllm": (True, "future_use"), "kmesh_vllm_lru": (False, "lru")}
# The store of the runs that measure what KMesh through vLLM computes with nothing lost: far
# more than a few rounds of 32 agents' transcripts (about 2 GiB at 512 tokens each).
UNBOUNDED_STORE = 8 << 30


def kmesh_through_vllm(
    name: str,
    spec: dict[str, Any],
    sizing: EngineSizing,
    agents: int,
    directory: Path,
    unconstrained: dict[int, list[float]],
) -> dict[str, Any]:
    """KMesh through vLLM on one agent count's trace (bench/capacity/vllm.py::replay): vLLM's
    KV cache holds one request of max_model_len (the least it starts with), the store the rest
    of the budget (`sizing`); what the same requests compute on an unbounded store
    (`unconstrained`, run once per agent count) is what nothing lost costs."""
    declare, retention = KMESH_VLLM_STRATEGIES[name]
    kv_cache, capacity = sizing.kv_cache_bytes, sizing.offload_bytes
    spec = {**spec, "max_model_len": sizing.max_model_len, "kv_cache_bytes": kv_cache}
    if agents not in unconstrained:
        free = replayed(spec, "unbounded", UNBOUNDED_STORE, "lru", directory / f"free-{agents}")
        if "error" in free:
            return {"agents": agents, "error": free["error"]}
        unconstrained[agents] = [r["computed"] for r in free["rounds"]]
    got = replayed(spec, name, capacity, retention, directory / f"{name}-{agents}", declare)
    if "error" in got:
        return {"agents": agents, "error": got["error"]}
    computed = [r["computed"] for r in got["rounds"]]
    return {
        "agents": agents,
        "computed_tokens_per_round": computed,
        "unconstrained_tokens_per_round": unconstrained[agents],
        "recomputed_tokens_per_round": [
            max(0.0, c - u) for c, u in zip(computed, unconstrained[agents], strict=True)
        ],
        "prefill_seconds_per_round": [r["seconds"] for r in got["rounds"]],
        "store_bytes": capacity,
        "kv_cache_bytes": kv_cache,
        "bytes_per_agent": got["store_used"] / agents,
        "bytes_restored": sum(r["restored_bytes"] for r in got["rounds"]),
    }


def replayed(
    spec: dict[str, Any],
    name: str,
    capacity: int,
    retention: str,
    folder: Path,
    declare: bool = False,
) -> dict[str, Any]:
    """One replay through vLLM on a fresh store of `capacity` bytes: its rounds and the store's
    bytes after the last, or {"error": why}."""
    from kmesh.store.client import StoreClient
    from kmesh.store.process import start_store

    folder.mkdir()
    store = start_store(folder, str(capacity), retention=retention)
    try:
        spec = {**spec, "store": store.socket, "declare": declare, "connector": None}
        result = run_vllm_process(spec, folder / name)
        if "error" in result:
            return result
        with StoreClient(store.socket) as client:
            used = int(client.stats()["used"])
    finally:
        store.stop()
    return {"rounds": result["runs"][0]["rounds"], "store_used": used}
