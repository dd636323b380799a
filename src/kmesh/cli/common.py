"""What the command modules share: the --model and --store options, agent-count lists, the store
socket check and a bench's report (its table, JSON and plot)."""

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kmesh.errors import InvalidRequestError

# What `add_subparsers()` returns, where each command module registers its parsers (argparse's
# class for it is private).
Commands = Any


def add_model_option(parser: argparse.ArgumentParser) -> None:
    """--model: a model folder; the embedded model when absent."""
    parser.add_argument("--model", default=None, help="model folder (default: the embedded model)")


def add_report_option(parser: argparse.ArgumentParser) -> None:
    """--json: where a bench writes its report (required)."""
    parser.add_argument("--json", required=True, help="where to write the report")


def add_store_option(parser: argparse.ArgumentParser) -> None:
    """--store: a store's socket, checked by `check_store`."""
    parser.add_argument(
        "--store", default=None, help="a `kmesh store serve` socket: restore from it, publish to it"
    )


def agent_counts(text: str | None, flag: str = "--scale", minimum: int = 2) -> list[int]:
    """Agent counts given as "4,8,16" to `flag` (none when the flag is absent)."""
    if text is None:
        return []
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise InvalidRequestError(
            f"{flag} takes agent counts separated by commas, like 4,8,16; got {text!r}"
        ) from None
    if any(n < minimum for n in counts):
        raise InvalidRequestError(f"{flag} agent counts must be at least {minimum}")
    return counts


def check_store(store: str | None) -> None:
    """Refuse a --store socket path where no store listens."""
    if store is not None and not Path(store).exists():
        raise InvalidRequestError(
            f"no store socket at {store!r}: start one with `kmesh store serve --socket PATH`"
        )


def write_json(path: str, report: dict[str, object]) -> None:
    """Write a benchmark report, creating its folder."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {target}")


def emit_report(
    args: argparse.Namespace,
    result: dict[str, Any],
    print_report: Callable[[dict[str, Any], Any], None],
    plot: Callable[[dict[str, Any], Path], None],
) -> None:
    """Print a bench's table, write its JSON to --json and draw its plot to --plot if given."""
    from kmesh.bench.common import report_console

    print_report(result, report_console())
    write_json(args.json, result)
    if args.plot:
        plot(result, Path(args.plot))
