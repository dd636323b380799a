"""`kmesh bench load`: kmesh serve under concurrent clients, disconnects and bad bodies."""

import argparse

from kmesh.cli.bench_common import add_bench_options, config_from_args, emit_report, progress
from kmesh.cli.common import Commands
from kmesh.extras import VLLM, require


def _bench_load(args: argparse.Namespace) -> None:
    if args.engine != "reference":
        require(VLLM, f"kmesh bench load --engine {args.engine}")
    from kmesh.bench.load.report import plot, print_report
    from kmesh.bench.load.run import LoadConfig, run_load_bench

    cfg = config_from_args(LoadConfig, args)
    log = progress()
    result = run_load_bench(cfg, log)
    emit_report(args, result, print_report, plot)


def register(benches: Commands) -> None:
    load = benches.add_parser(
        "load",
        help="kmesh serve under concurrent clients, disconnects, families, rounds, bad bodies",
    )
    load.add_argument(
        "--engine",
        choices=["reference", "vllm", "vllm-vanilla"],
        default="reference",
        help="vllm-vanilla: vLLM's own server, no KMesh (with --mix plain)",
    )
    load.add_argument(
        "--mix",
        choices=["full", "plain"],
        default="full",
        help="full: every kind; plain: only what any OpenAI server takes (plain, chat, stream, "
        "disconnect), to compare with vllm-vanilla",
    )
    load.add_argument("--clients", type=int, default=32, help="concurrent clients")
    load.add_argument("--seconds", type=float, default=600, help="how long the soak runs")
    load.add_argument(
        "--check", type=int, default=60, help="exact answers compared with a cold run after"
    )
    load.add_argument(
        "--abandon",
        type=int,
        default=0,
        help="then open this many families and rounds and never close them (RSS figure)",
    )
    load.add_argument("--seed", type=int, default=0)
    add_bench_options(load, _bench_load, plot="RSS and store bytes", model=False)
