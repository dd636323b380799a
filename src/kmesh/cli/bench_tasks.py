"""`kmesh bench tasks`: agents' reading of their siblings' messages, scored against ground truth
under each reuse strategy and budget (bench/tasks/run.py)."""

import argparse

from kmesh.bench.tasks.config import TasksBenchConfig
from kmesh.cli.bench_common import (
    add_bench_options,
    add_config_flag,
    config_from_args,
    emit_report,
    progress,
)
from kmesh.cli.common import Commands
from kmesh.workloads.allgather import ORDERS
from kmesh.workloads.tasks import TasksConfig


def _bench_tasks(args: argparse.Namespace) -> None:
    from kmesh.bench.allgather.config import AllGatherBenchConfig
    from kmesh.bench.tasks.report import plot_tasks, print_tasks

    workload = config_from_args(TasksConfig, args)
    bench = config_from_args(
        TasksBenchConfig,
        args,
        budgets=tuple(float(b) for b in args.budgets.split(",")) if args.budgets else (),
        per_request=not args.no_per_request,
    )
    base = AllGatherBenchConfig(
        gate=None if args.no_gate else args.gate,
        gate_sample=args.gate_sample,
        check_layer=args.check_layer,
        master=args.master,
    )
    log = progress()
    if args.engine == "vllm":
        from kmesh.bench.tasks.vllm import run_vllm_tasks

        report = run_vllm_tasks(workload, bench, base, args.model, log)
    else:
        from kmesh.bench.tasks.reference import run_reference_tasks

        report = run_reference_tasks(workload, bench, base, args.model, log)
    emit_report(args, report, print_tasks, plot_tasks)


def register(benches: Commands) -> None:
    tasks = benches.add_parser(
        "tasks",
        help="agents' reading of their siblings' messages, scored against ground truth, per "
        "reuse strategy and recompute budget",
    )
    workload, bench = TasksConfig(), TasksBenchConfig()
    add_config_flag(tasks, workload, "agents", "council members")
    add_config_flag(tasks, workload, "rounds", "rounds (probes from round 2 on)")
    add_config_flag(tasks, workload, "seed", "seed of the facts, filler and orders")
    add_config_flag(tasks, workload, "order", "each member's reading order", choices=ORDERS)
    add_config_flag(tasks, workload, "filler", "filler sentences around each message's facts")
    add_config_flag(tasks, bench, "budgets", "recompute shares of the reused rows")
    add_config_flag(tasks, bench, "selections", "selections measured beside the default")
    add_config_flag(tasks, bench, "default_selection", "collective's and per_request's selection")
    add_config_flag(tasks, bench, "tasks", "which tasks to score")
    add_config_flag(tasks, bench, "accuracy_gate", "full prefill accuracy a headline task needs")
    tasks.add_argument("--no-per-request", action="store_true", help="skip per_request's runs")
    tasks.add_argument(
        "--gate",
        type=float,
        default=0.1,
        help="recovery's quality gate: mean relative key deviation at the check layer above which "
        "a region is computed in full (default 0.1)",
    )
    tasks.add_argument("--no-gate", action="store_true", help="no quality gate")
    tasks.add_argument(
        "--gate-sample", type=float, default=0.125, help="share the gate checks (default 0.125)"
    )
    tasks.add_argument(
        "--check-layer", type=int, default=None, help="default: the model's (recovery)"
    )
    tasks.add_argument(
        "--master", choices=["sibling", "common"], default="sibling", help="collective's master"
    )
    tasks.add_argument(
        "--engine",
        choices=["vllm", "reference"],
        default="vllm",
        help="vllm: vLLM with KMeshConnector; reference: KMesh's own engine",
    )
    add_bench_options(tasks, _bench_tasks, plot="retention against computed tokens")
