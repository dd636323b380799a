"""What the command modules share: the --model and --store options and the store socket check
(what only the bench commands share: cli/bench_common.py)."""

import argparse
from pathlib import Path
from typing import Any

from kmesh.errors import InvalidRequestError

# What `add_subparsers()` returns, where each command module registers its parsers (argparse's
# class for it is private).
Commands = Any
# A parser or one of its argument groups (argparse's common base class is private).
Options = argparse._ActionsContainer


def add_model_option(parser: Options) -> None:
    """--model: a model folder; the embedded model when absent."""
    parser.add_argument(
        "--model",
        default=None,
        help="a packaged model's name (SmolLM2-135M-Instruct, gemma-3-270m) or a model folder "
        "(default: the embedded model)",
    )


def add_store_option(parser: Options) -> None:
    """--store: a store's socket, checked by `check_store`."""
    parser.add_argument(
        "--store", default=None, help="a `kmesh store serve` socket: restore from it, publish to it"
    )


def check_store(store: str | None) -> None:
    """Refuse a --store socket path where no store listens."""
    if store is not None and not Path(store).exists():
        raise InvalidRequestError(
            f"no store socket at {store!r}: start one with `kmesh store serve --socket PATH`"
        )
