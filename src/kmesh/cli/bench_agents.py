"""`kmesh bench agents`: agents over the OpenAI chat API, kmesh serve against plain vLLM."""

import argparse

from kmesh.cli.bench_common import add_bench_options, agent_counts, config_from_args, emit_report
from kmesh.cli.common import Commands


def _bench_agents(args: argparse.Namespace) -> None:
    from rich.console import Console

    from kmesh.bench.agents import run_agents_bench
    from kmesh.bench.agents_config import AgentsBenchConfig
    from kmesh.bench.agents_report import plot, print_report

    cfg = config_from_args(
        AgentsBenchConfig,
        args,
        agents=tuple(agent_counts(args.agents, "--agents")),
        slo_ttft_s=args.slo_ttft,
        strategies=tuple(args.strategies.split(",")),
        stagger_s=args.stagger,
        serial_check=not args.no_serial_check,
    )
    console = Console(stderr=True)
    emit_report(args, run_agents_bench(cfg, console.log), print_report, plot)


def register(benches: Commands) -> None:
    from kmesh.bench.agents_config import ENGINES, STRATEGIES, AgentsBenchConfig
    from kmesh.workloads.agent_chats import WORKLOADS
    from kmesh.workloads.allgather import ORDERS

    default = AgentsBenchConfig()  # the one place the bench's defaults are set
    agents = benches.add_parser(
        "agents",
        help="agents arriving together over the chat API: makespan, TTFT and agents under an "
        "SLO, kmesh serve against plain vLLM",
    )
    agents.add_argument("--workload", choices=WORKLOADS, default=default.workload)
    counts = ",".join(map(str, default.agents))
    agents.add_argument(
        "--agents", default=counts, help=f"agent counts, comma-separated (default {counts})"
    )
    agents.add_argument("--rounds", type=int, default=default.rounds)
    agents.add_argument("--seed", type=int, default=default.seed)
    agents.add_argument("--order", choices=ORDERS, default=default.order, help="allgather's orders")
    agents.add_argument(
        "--slo-ttft",
        type=float,
        default=default.slo_ttft_s,
        help=f"seconds; TTFT p99 under it holds an agent count (default {default.slo_ttft_s:g}: "
        "docs/AGENTS.md says why)",
    )
    agents.add_argument(
        "--max-tokens", type=int, default=default.max_tokens, help="greedy tokens per message"
    )
    agents.add_argument("--engine", choices=ENGINES, default=default.engine)
    agents.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help=f"comma-separated, vllm included (default {','.join(STRATEGIES)})",
    )
    agents.add_argument(
        "--kv-cache",
        default=default.kv_cache,
        help=f"both servers' vLLM KV cache (default {default.kv_cache})",
    )
    agents.add_argument(
        "--store-capacity",
        default=default.store_capacity,
        help=f"KMesh's store (default {default.store_capacity})",
    )
    agents.add_argument("--per-request-ratio", type=float, default=default.per_request_ratio)
    agents.add_argument(
        "--agent-ratio", type=float, default=default.agent_ratio, help="kmesh_collective's"
    )
    agents.add_argument(
        "--context-tokens",
        type=int,
        default=default.context_tokens,
        help=f"trajectory: each agent's start (default {default.context_tokens})",
    )
    agents.add_argument(
        "--tool-tokens", type=int, default=default.tool_tokens, help="trajectory: each turn's"
    )
    agents.add_argument(
        "--stagger",
        type=float,
        default=default.stagger_s,
        help="trajectory: seconds between arrivals",
    )
    agents.add_argument(
        "--no-serial-check",
        action="store_true",
        help="skip sending kmesh_exact's calls again one at a time",
    )
    add_bench_options(agents, _bench_agents, plot="makespan and TTFT p99")
