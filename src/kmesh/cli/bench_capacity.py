"""`kmesh bench capacity`: agents served under one memory budget, vLLM and KMesh side by side."""

import argparse

from kmesh.cli.bench_common import (
    add_bench_options,
    add_config_flag,
    config_from_args,
    emit_report,
    progress,
)
from kmesh.cli.common import Commands
from kmesh.extras import VLLM, require


def _bench_capacity(args: argparse.Namespace) -> None:
    require(VLLM, "kmesh bench capacity")  # vanilla vLLM's rounds are the trace
    from kmesh.bench.capacity.config import CapacityConfig
    from kmesh.bench.capacity.report import plot, print_report
    from kmesh.bench.capacity.run import run_capacity_bench

    cfg = config_from_args(CapacityConfig, args)
    log = progress()
    result = run_capacity_bench(cfg, args.model, log)
    emit_report(args, result, print_report, plot)


def register(benches: Commands) -> None:
    from kmesh.bench.capacity.config import CapacityConfig
    from kmesh.workloads.allgather import ORDERS

    default = CapacityConfig()
    capacity = benches.add_parser(
        "capacity",
        help="agents served under one memory budget: vanilla vLLM, its offloading, KMesh's store",
    )
    add_config_flag(capacity, default, "agents", "agent counts, comma-separated")
    add_config_flag(capacity, default, "rounds", "rounds (trajectory: turns) per agent count")
    budget = "memory every strategy gets: vLLM's KV cache, or KMesh's store plus one request"
    add_config_flag(capacity, default, "budget_mib", budget)
    add_config_flag(capacity, default, "workload", choices=["allgather", "trajectory"])
    add_config_flag(capacity, default, "order", choices=ORDERS)
    add_config_flag(capacity, default, "seed")
    add_config_flag(capacity, default, "output_tokens", "each answer's tokens")
    add_config_flag(capacity, default, "tool_tokens", "trajectory: each tool result's tokens")
    diff = "share of each mirrored member's blocks recovery recomputes (its mirror's diff)"
    add_config_flag(capacity, default, "agent_ratio", diff)
    strategies = (
        "a subset, vanilla included: vanilla,vanilla_offload,kmesh_dense,kmesh,kmesh_lru,"
        "kmesh_vllm,kmesh_vllm_lru (the last two: KMesh through vLLM, All-Gather only; "
        "empty: every strategy of the workload)"
    )
    add_config_flag(capacity, default, "strategies", strategies)
    add_bench_options(capacity, _bench_capacity, plot="computed tokens vs agents", engine="vllm")
