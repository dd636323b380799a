"""`kmesh bench capacity`: how many agents one memory budget serves, strategies side by side.

Every strategy gets the same budget B for what it keeps between rounds plus what it computes in:
- vanilla: vLLM with prefix caching, its KV cache = B (bench/capacity/vllm.py, its own process);
- vanilla_offload: vLLM with half of B as KV cache (at least one request's) and its own CPU
  offloading of the rest (SimpleCPUOffloadConnector, else OffloadingConnector), if one runs on
  this build (otherwise their errors are reported);
- kmesh_dense / kmesh / kmesh_lru: KMesh's store holding every member's transcript between
  rounds (bench/capacity/kmesh.py: restored each round, lost pieces computed again), with
  collective recovery of each round: dense pieces / Master-Mirror pieces with retention by
  declared future use / Master-Mirror pieces with LRU. The store gets B minus the working set of
  one request (the largest prompt's KV): the least an engine needs to compute in;
- kmesh_vllm / kmesh_vllm_lru (All-Gather): the same through vLLM with KMeshConnector
  (bench/capacity/vllm.py::replay): its KV cache one request of max_model_len, the store the rest of
  B (every vLLM engine's max_model_len and KV cache: bench/capacity/sizing.py); members declare
  their next use and the store retains by it / nothing declared and the store evicts least recently
  used. What the same requests compute on an unbounded store is their
  `unconstrained_tokens_per_round`, the excess their `recomputed_tokens_per_round`.
Workloads: the All-Gather council (workloads/allgather.py), or agent trajectories
(workloads/trajectory.py: a turn is a round; no masters, so kmesh_dense is kmesh there).
The vanilla run is closed loop (vLLM answers, greedy) and its rounds are the trace every other
strategy replays, so all compute the same prompts.

Per agent count and round: computed tokens (vLLM: prompt tokens minus its prefix-cache hit; KMesh:
token-layers / layers of recovery, restore misses included) and the round's new tokens (those of
segments no earlier round held, counted once: workloads/allgather.py::new_tokens; a trajectory
turn's: its append); prefill seconds (vLLM: its prefill call; KMesh: the reference executor's
restore + recovery, not comparable across engines: vLLM's CPU kernels are faster); bytes held per
agent after the last round (KMesh: the store's bytes / agents; vanilla and vanilla_offload: its
transcript's dense KV, at most B / agents); bytes restored. `max_agents.<name>`: the largest agent
count whose every round computes within `limit` (All-Gather 2x, trajectory 1.5x) of the round's new
tokens; `capacity_agents.<name>`: the largest whose every round stays within 2x of what the same
strategy computes with unlimited memory (vanilla: an ideal prefix cache; KMesh: no piece lost), the
memory effect alone.
"""

import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kmesh.bench.capacity.accounting import (
    dense_transcript_bytes,
    ideal_prefix_cache,
    max_agents,
    token_bytes,
)
from kmesh.bench.capacity.config import CapacityConfig
from kmesh.bench.capacity.process import run_vllm_process
from kmesh.bench.capacity.replay import KMESH_VLLM_STRATEGIES, kmesh_through_vllm
from kmesh.bench.capacity.sizing import EngineSizing, check_budget, engine_sizing
from kmesh.errors import InvalidRequestError
from kmesh.workloads.allgather import new_tokens

VLLM_STRATEGIES = ("vanilla", "vanilla_offload")
# KMesh strategy -> (piece layout, pieces declared for their next use, store retention)
KMESH_STRATEGIES = {
    "kmesh_dense": ("dense", True, "future_use"),
    "kmesh": ("mirror", True, "future_use"),
    "kmesh_lru": ("mirror", False, "lru"),
}
# vLLM's own offloading to CPU memory, tried in this order for vanilla_offload.
OFFLOAD_CONNECTORS = ("SimpleCPUOffloadConnector", "OffloadingConnector")


def run_capacity_bench(
    cfg: CapacityConfig, model: str | None, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """The whole run (module docstring); its report as a JSON-ready dict."""
    from kmesh.bench.common import hardware
    from kmesh.compute.loader import load_model

    per_token = token_bytes(model)
    check_budget(cfg, per_token)
    loaded = load_model(model)
    strategies: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kmc-") as folder:
        directory = Path(folder)
        for name in (s for s in VLLM_STRATEGIES if s in cfg.chosen):
            log(f"capacity: {name} (vLLM) at {list(cfg.agents)} agents")
            sizing = engine_sizing(cfg, name, per_token)
            strategies[name] = _vllm(cfg, name, sizing, model, loaded.fingerprint, directory)
        if "error" in strategies["vanilla"]:
            raise InvalidRequestError(
                f"vanilla vLLM did not run, so there is no trace: {strategies['vanilla']['error']}"
            )
        traces = {n: _trace(directory / f"trace-{n}.jsonl") for n in cfg.agents}
        for name in (s for s in KMESH_STRATEGIES if s in cfg.chosen):
            strategies[name] = {"runs": []}
            for agents in cfg.agents:
                log(f"capacity: {name} at {agents} agents")
                run = _kmesh(cfg, name, loaded, traces[agents], per_token, directory)
                strategies[name]["runs"].append(run)
        unconstrained: dict[int, list[float]] = {}
        for name in (s for s in KMESH_VLLM_STRATEGIES if s in cfg.chosen):
            strategies[name] = {"runs": []}
            for agents in cfg.agents:
                log(f"capacity: {name} (vLLM) at {agents} agents")
                spec = {"model": model, "agent_ratio": cfg.agent_ratio}
                spec |= {"replay": str(directory / f"trace-{agents}.jsonl")}
                sizing = engine_sizing(cfg, name, per_token)
                run = kmesh_through_vllm(name, spec, sizing, agents, directory, unconstrained)
                if "error" in run:
                    strategies[name] = {"error": run["error"]}
                    break
                strategies[name]["runs"].append(run)
    for strategy in strategies.values():
        for run in strategy.get("runs", []):
            rounds = traces[run["agents"]]
            run["new_tokens_per_round"] = new_tokens(rounds)
            run["dense_bytes_per_agent"] = dense_transcript_bytes(rounds, per_token)
    for name in VLLM_STRATEGIES:  # vLLM's KV cache (and its offloading) hold the transcripts
        for run in strategies.get(name, {}).get("runs", []):
            held = cfg.budget_bytes / run["agents"]
            run["bytes_per_agent"] = min(run["dense_bytes_per_agent"], held)
    return {
        "config": asdict(cfg),
        "hardware": hardware(),
        "budget_bytes": cfg.budget_bytes,
        "limit": cfg.limit,
        "strategies": strategies,
        "max_agents": {
            n: max_agents(s, "new_tokens_per_round", cfg.limit) for n, s in strategies.items()
        },
        "capacity_agents": {
            n: max_agents(s, "unconstrained_tokens_per_round", 2.0) for n, s in strategies.items()
        },
    }


def _vllm(
    cfg: CapacityConfig,
    name: str,
    sizing: EngineSizing,
    model: str | None,
    fingerprint: str,
    directory: Path,
) -> dict[str, Any]:
    """One vLLM strategy in its own process, its engine sized by `sizing` (vanilla_offload:
    each of vLLM's offloading connectors until one runs); its runs, or why it did not run."""
    spec = {
        "model": model,
        "strategy": name,
        "max_model_len": sizing.max_model_len,
        "kv_cache_bytes": sizing.kv_cache_bytes,
        "offload_bytes": sizing.offload_bytes,
        "agents": list(cfg.agents),
        "rounds": cfg.rounds,
        "order": cfg.order,
        "seed": cfg.seed,
        "output_tokens": cfg.output_tokens,
        "workload": cfg.workload,
        "tool_tokens": cfg.tool_tokens,
        "fingerprint": fingerprint,
        "traces": str(directory) if name == "vanilla" else None,
    }
    errors = []
    for connector in OFFLOAD_CONNECTORS if name == "vanilla_offload" else (None,):
        result = run_vllm_process({**spec, "connector": connector}, directory / (connector or name))
        if "error" not in result:
            break
        errors.append(f"{connector}: {result['error']}" if connector else result["error"])
    else:
        return {"error": "; ".join(errors)}
    runs = []
    for run in result["runs"]:
        rounds = run["rounds"]
        runs.append(
            {
                "agents": run["agents"],
                "computed_tokens_per_round": [r["computed"] for r in rounds],
                "prefill_seconds_per_round": [r["seconds"] for r in rounds],
                "unconstrained_tokens_per_round": ideal_prefix_cache(
                    _trace(directory / f"trace-{run['agents']}.jsonl")
                ),
                "bytes_restored": 0,
            }
        )
    return {"runs": runs, "connector": result.get("connector")} | asdict(sizing)


def _kmesh(
    cfg: CapacityConfig,
    name: str,
    loaded: Any,
    turns: list[list[Any]],
    per_token: int,
    directory: Path,
) -> dict[str, Any]:
    from kmesh.bench.allgather.config import AllGatherBenchConfig
    from kmesh.bench.capacity.kmesh import GroupStateRun
    from kmesh.store.process import start_store

    layout, declare, retention = KMESH_STRATEGIES[name]
    working = per_token * max(len(t.prompt.token_ids) for ts in turns for t in ts)
    capacity = cfg.budget_bytes - working
    if capacity < 1:
        raise InvalidRequestError(
            f"--budget-mib {cfg.budget_mib} is below one request's KV ({working >> 20} MiB at "
            f"{len(turns[0])} agents): raise it"
        )
    folder = directory / f"{name}-{len(turns[0])}"
    folder.mkdir()
    store = start_store(folder, str(capacity), retention=retention)
    try:
        stats = GroupStateRun(
            loaded.executor,
            loaded.fingerprint,
            turns,
            store.socket,
            layout,
            declare,
            AllGatherBenchConfig().recovery(cfg.agent_ratio),
            collective=cfg.workload == "allgather",
        ).run()
    finally:
        store.stop()
    last = stats[-1]
    return {
        "agents": len(turns[0]),
        "computed_tokens_per_round": [s.round_computed + s.recomputed for s in stats],
        "prefill_seconds_per_round": [s.seconds for s in stats],
        "unconstrained_tokens_per_round": [s.round_computed for s in stats],
        "recomputed_tokens_per_round": [s.recomputed for s in stats],
        "pieces_lost": sum(s.pieces_lost for s in stats),
        "restores_checked": sum(s.restores_checked for s in stats),
        "restore_mismatches": sum(s.restore_mismatches for s in stats),
        "store_bytes": capacity,
        "bytes_per_agent": last.held_bytes / len(turns[0]),
        "transcript_bytes_per_agent": last.transcript_bytes,
        "own_bytes_per_agent": last.own_bytes,
        "transcript_bytes_per_agent_per_round": [s.transcript_bytes for s in stats],
        "bytes_restored": sum(s.bytes_restored for s in stats),
    }


def _trace(path: Path) -> list[list[Any]]:
    from kmesh.workloads.allgather import group_rounds
    from kmesh.workloads.trace import load_trace

    return group_rounds(load_trace(path)[2])
