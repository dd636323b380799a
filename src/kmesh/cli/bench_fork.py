"""`kmesh bench fork`: best-of-N, chain-of-thought and tree search, independent vs prefix cache
vs fork (bench/fork/run.py; bench/fork/vllm.py with --engine vllm)."""

import argparse

from kmesh.cli.bench_common import add_bench_options, config_from_args, emit_report, progress
from kmesh.cli.common import Commands
from kmesh.errors import InvalidRequestError
from kmesh.extras import VLLM, require


def _bench_fork(args: argparse.Namespace) -> None:
    if args.engine == "vllm":
        require(VLLM, "kmesh bench fork --engine vllm")
    from kmesh.bench.fork.run import ForkBenchConfig, print_report, run_fork_bench
    from kmesh.compute.loader import load_model

    cfg = config_from_args(ForkBenchConfig, args)
    log = progress()
    model = load_model(args.model)
    needed = cfg.trunk_tokens + cfg.reasoning_tokens + 2 * cfg.branch_tokens
    context = args.max_model_len or model.config.max_position
    if needed > context:
        raise InvalidRequestError(
            f"trunk + reasoning + branch tokens ({needed}) exceed the context ({context} "
            "tokens): shorten the workload or raise --max-model-len"
        )
    if args.engine == "vllm":
        from kmesh.bench.fork.vllm import print_vllm_report, run_vllm_fork_bench

        report = run_vllm_fork_bench(cfg, args.model, args.max_model_len, progress=log)
        emit_report(args, report, print_vllm_report)
    else:
        report = run_fork_bench(model.executor, model.fingerprint, cfg, progress=log)
        emit_report(args, report, print_report)


def register(benches: Commands) -> None:
    fork = benches.add_parser(
        "fork",
        help="best-of-N / chain-of-thought / tree search: independent vs prefix cache vs fork",
    )
    fork.add_argument("--mode", choices=["best-of-n", "cot", "tree"], required=True)
    fork.add_argument(
        "--engine",
        choices=["reference", "vllm"],
        default="reference",
        help="vllm: independent requests vs vLLM's n vs kmesh serve's n, on vLLM",
    )
    fork.add_argument("--branches", type=int, default=8, help="branches (tree: width per level)")
    fork.add_argument("--trunk-tokens", type=int, default=1024, help="prompt length")
    fork.add_argument("--branch-tokens", type=int, default=32, help="tokens each branch generates")
    fork.add_argument(
        "--reasoning-tokens",
        type=int,
        default=64,
        help="cot: trunk tokens generated before forking",
    )
    fork.add_argument("--seed", type=int, default=0)
    add_bench_options(fork, _bench_fork, context=True)
