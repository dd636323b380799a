"""`kmesh bench capacity`: agents served under one memory budget, vLLM and KMesh side by side."""

import argparse

from kmesh.cli.bench_common import add_bench_options, config_from_args, emit_report
from kmesh.cli.common import Commands


def _bench_capacity(args: argparse.Namespace) -> None:
    from rich.console import Console

    from kmesh.bench.capacity import CapacityConfig, run_capacity_bench
    from kmesh.bench.capacity_report import plot, print_report

    cfg = config_from_args(CapacityConfig, args)
    console = Console(stderr=True)
    result = run_capacity_bench(cfg, args.model, console.log)
    emit_report(args, result, print_report, plot)


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 4,8,16; got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(n for n in text.split(",") if n)


def register(benches: Commands) -> None:
    capacity = benches.add_parser(
        "capacity",
        help="agents served under one memory budget: vanilla vLLM, its offloading, KMesh's store",
    )
    capacity.add_argument("--agents", type=_counts, default=(4, 8, 16, 32), help="like 4,8,16,32")
    capacity.add_argument(
        "--rounds", type=int, default=3, help="rounds (trajectory: turns) per agent count"
    )
    capacity.add_argument(
        "--budget-mib",
        type=int,
        default=512,
        help="memory every strategy gets: vLLM's KV cache, or KMesh's store plus one request",
    )
    capacity.add_argument("--workload", choices=["allgather", "trajectory"], default="allgather")
    capacity.add_argument("--order", choices=["same", "rotate", "shuffle"], default="shuffle")
    capacity.add_argument("--seed", type=int, default=0)
    capacity.add_argument("--output-tokens", type=int, default=48, help="each answer's tokens")
    capacity.add_argument(
        "--tool-tokens", type=int, default=256, help="trajectory: each tool result's tokens"
    )
    capacity.add_argument(
        "--agent-ratio",
        type=float,
        default=0.0,
        help="share of each mirrored member's blocks recovery recomputes (its mirror's diff)",
    )
    capacity.add_argument(
        "--strategies",
        type=_names,
        default=(),
        help="a subset, vanilla included: vanilla,vanilla_offload,kmesh_dense,kmesh,kmesh_lru,"
        "kmesh_vllm,kmesh_vllm_lru (the last two: KMesh through vLLM, All-Gather only)",
    )
    add_bench_options(capacity, _bench_capacity, plot="computed tokens vs agents")
