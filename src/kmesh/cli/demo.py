"""`kmesh demo`: a small All-Gather served by plain vLLM and by kmesh serve, then the laboratory
(kmesh/demo.py)."""

import argparse
from pathlib import Path

from kmesh.cli.common import Commands, add_model_option, check_model


def _demo(args: argparse.Namespace) -> None:
    from kmesh.bench.common import report_console
    from kmesh.demo import run_lab, run_served

    check_model(args.model, "reference" if args.lab_only else "vllm")
    console = report_console()
    if not args.lab_only:
        run_served(console, args.model)
    run_lab(console, args.model, args.report)


def register(commands: Commands) -> None:
    demo = commands.add_parser(
        "demo",
        help="4 agents, 2 All-Gather rounds served by plain vLLM and by kmesh serve side by "
        "side, then the same council in the reference engine",
    )
    add_model_option(demo)
    demo.add_argument(
        "--lab-only",
        action="store_true",
        help="skip the served comparison (it starts three vLLM servers, about 3 minutes)",
    )
    demo.add_argument(
        "--report",
        type=Path,
        default=Path("kmesh-demo-report"),
        help="where the laboratory's report.md and plots go (default kmesh-demo-report)",
    )
    demo.set_defaults(func=_demo)
