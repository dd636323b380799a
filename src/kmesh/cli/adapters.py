"""`kmesh adapters prepare`: train (once, deterministically) and cache the persona LoRA adapters
that `kmesh bench lora` runs (kmesh/adapters)."""

import argparse

from kmesh.adapters.recipes import KINDS
from kmesh.cli.common import Commands
from kmesh.errors import InvalidRequestError


def _prepare(args: argparse.Namespace) -> None:
    from kmesh.adapters.prepare import ensure_adapters

    if args.count < 1:
        raise InvalidRequestError(f"--count must be at least 1, got {args.count}")
    for kind in KINDS if args.kind == "all" else (args.kind,):
        for path in ensure_adapters(kind, args.count):
            print(path)


def register(commands: Commands) -> None:
    adapters = commands.add_parser("adapters", help="LoRA adapters for the embedded model")
    adapter_commands = adapters.add_subparsers(dest="adapters_command", required=True)
    prepare = adapter_commands.add_parser(
        "prepare", help="train (once, deterministically) and cache persona adapters"
    )
    prepare.add_argument("--kind", choices=[*KINDS, "all"], default="all")
    prepare.add_argument("--count", type=int, default=4, help="adapters of each kind")
    prepare.set_defaults(func=_prepare)
