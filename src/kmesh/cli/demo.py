"""`kmesh demo`: a generation, then a small All-Gather benchmark (kmesh/demo.py)."""

import argparse

from kmesh.cli.common import Commands, add_model_option


def _demo(args: argparse.Namespace) -> None:
    from kmesh.demo import run_demo

    run_demo(args.model)


def register(commands: Commands) -> None:
    demo = commands.add_parser(
        "demo", help="a generation, then a small All-Gather benchmark (4 agents, 2 rounds)"
    )
    add_model_option(demo)
    demo.set_defaults(func=_demo)
