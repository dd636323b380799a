"""`kmesh bench council`: an unmodified agent framework against KMesh and vanilla vLLM."""

import argparse

from kmesh.cli.bench_common import add_bench_options, config_from_args, emit_report, progress
from kmesh.cli.common import Commands
from kmesh.errors import InvalidRequestError
from kmesh.extras import VLLM, require
from kmesh.state.recovery_meta import check_quality_target


def _bench_council(args: argparse.Namespace) -> None:
    require(VLLM, "kmesh bench council")  # vanilla vLLM's council is the reference
    from kmesh.bench.council.report import plot, print_report
    from kmesh.bench.council.run import CouncilConfig, client_python, run_council_bench

    cfg = config_from_args(CouncilConfig, args)
    python = client_python(args.client_python)
    log = progress()
    try:
        ratios = tuple(float(r) for r in args.ratios.split(",") if r)
    except ValueError:
        raise InvalidRequestError(
            f"--ratios are numbers, comma-separated, got {args.ratios!r}"
        ) from None
    if not all(0 <= r <= 1 for r in ratios):
        raise InvalidRequestError(f"--ratios are shares in [0, 1], got {args.ratios}")
    qualities = tuple(check_quality_target(q, "--quality") for q in args.quality.split(",") if q)
    if not ratios and not qualities:
        raise InvalidRequestError("nothing to run: give --ratios or --quality")
    result = run_council_bench(cfg, args.engine, ratios, python, log, qualities)
    emit_report(args, result, print_report, plot)


def register(benches: Commands) -> None:
    council = benches.add_parser(
        "council",
        help="an AutoGen council (unmodified) against kmesh serve and vanilla vLLM, per round",
    )
    council.add_argument("--engine", choices=["reference", "vllm"], default="vllm")
    council.add_argument("--agents", type=int, default=8, help="council members")
    council.add_argument("--rounds", type=int, default=3, help="turns of every member")
    council.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per message")
    council.add_argument(
        "--ratios",
        default="0.3",
        help="kmesh serve --reuse-ratio values to run, comma-separated (default 0.3; '' for none)",
    )
    council.add_argument(
        "--quality",
        default="",
        help="kmesh serve --quality targets to run too, comma-separated (e.g. greedy,kl:0.05)",
    )
    council.add_argument(
        "--client-python",
        default=None,
        help="Python of a venv with clients/autogen.txt (default: .venv-clients: make clients)",
    )
    add_bench_options(council, _bench_council, plot="computed tokens per round")
