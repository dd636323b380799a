"""`kmesh bench agents`: agents over the OpenAI chat API, kmesh serve against plain vLLM."""

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


def _bench_agents(args: argparse.Namespace) -> None:
    require(VLLM, "kmesh bench agents")  # plain vLLM's server is every run's reference
    from kmesh.bench.agents.config import AgentsBenchConfig
    from kmesh.bench.agents.report import plot, print_report
    from kmesh.bench.agents.run import run_agents_bench

    cfg = config_from_args(
        AgentsBenchConfig,
        args,
        slo_ttft_s=args.slo_ttft,
        stagger_s=args.stagger,
        serial_check=not args.no_serial_check,
    )
    emit_report(args, run_agents_bench(cfg, progress()), print_report, plot)


def register(benches: Commands) -> None:
    from kmesh.bench.agents.config import ENGINES, AgentsBenchConfig
    from kmesh.compute.config import DTYPES
    from kmesh.workloads.agent_chats import WORKLOADS
    from kmesh.workloads.allgather import ORDERS

    default = AgentsBenchConfig()  # the one place the bench's defaults are set
    agents = benches.add_parser(
        "agents",
        help="agents arriving together over the chat API: makespan, TTFT and agents under an "
        "SLO, kmesh serve against plain vLLM",
    )
    add_config_flag(agents, default, "workload", choices=WORKLOADS)
    add_config_flag(agents, default, "agents", "agent counts, comma-separated")
    add_config_flag(agents, default, "rounds")
    add_config_flag(agents, default, "seed")
    add_config_flag(agents, default, "order", "allgather's and tasks' orders", choices=ORDERS)
    agents.add_argument(
        "--slo-ttft",
        type=float,
        default=default.slo_ttft_s,
        help=f"seconds; TTFT p99 under it holds an agent count (default {default.slo_ttft_s:g}: "
        "the SLO of docs/benchmarks.md)",
    )
    add_config_flag(agents, default, "max_tokens", "greedy tokens per message")
    add_config_flag(agents, default, "engine", choices=ENGINES)
    add_config_flag(agents, default, "strategies", "comma-separated, vllm included")
    add_config_flag(agents, default, "kv_cache", "both servers' vLLM KV cache")
    add_config_flag(
        agents,
        default,
        "dtype",
        "both vLLM servers' (bfloat16: vLLM's own pick here)",
        choices=DTYPES,
    )
    add_config_flag(agents, default, "store_capacity", "KMesh's store")
    add_config_flag(agents, default, "per_request_ratio", "kmesh_per_request's")
    add_config_flag(agents, default, "agent_ratio", "kmesh_collective's")
    add_config_flag(agents, default, "context_tokens", "trajectory: each agent's start")
    add_config_flag(agents, default, "tool_tokens", "trajectory: each turn's")
    agents.add_argument(
        "--stagger",
        type=float,
        default=default.stagger_s,
        help=f"trajectory: seconds between arrivals (default {default.stagger_s:g})",
    )
    add_config_flag(
        agents, default, "repeats", "passes over every strategy, servers started afresh each time"
    )
    agents.add_argument(
        "--no-serial-check",
        action="store_true",
        help="skip sending kmesh_exact's calls again one at a time",
    )
    add_bench_options(agents, _bench_agents, plot="makespan and TTFT p99", context=True)
