"""What the `kmesh bench` commands share: flags made from a bench's config fields (its defaults
set once, in the config), agent-count lists, a bench's config made from its flags, and its
report: the --json and --plot options, then its table, JSON and plot."""

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kmesh.cli.common import add_model_option, check_model
from kmesh.errors import InvalidRequestError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# A bench's config: a dataclass whose fields are (mostly) its flags.
Config = TypeVar("Config", bound="DataclassInstance")


def add_bench_options(
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], None],
    plot: str | None = None,
    model: bool = True,
    engine: str = "reference",
    context: bool = False,
) -> None:
    """What every bench command ends with: --json, where it writes its report (required); with
    `plot` (what its plot draws), --plot too, where `emit_report` draws it (optional); --model
    unless `model` is False (and --max-model-len with `context`, for a bench that passes it to
    its engine); `run` as its handler. With --model, a model or context vLLM with KMesh would
    refuse (the bench's --engine, else `engine`) is refused before `run` starts an engine
    (`check_model`); the reference engine's own load refuses a model it cannot run."""
    parser.add_argument("--json", required=True, help="where to write the report")
    if plot is not None:
        parser.add_argument("--plot", default=None, help=f"where to draw {plot}")
    if not model:
        parser.set_defaults(func=run)
        return
    add_model_option(parser, context=context)

    def checked(args: argparse.Namespace) -> None:
        on = getattr(args, "engine", engine)
        context = getattr(args, "max_model_len", None)
        if on.startswith("vllm") or context is not None:  # the reference engine's load refuses
            check_model(args.model, on, context)
        run(args)

    parser.set_defaults(func=checked)


def add_config_flag(
    parser: argparse.ArgumentParser,
    defaults: "DataclassInstance",
    name: str,
    help: str = "",
    **options: Any,
) -> None:
    """--name for the config field `name` (dashes for underscores): its default and, unless
    `options` give one or choices, its type come from `defaults` (the config made with its own
    defaults: the one place a bench sets them), and its help says the default. A tuple field
    takes its items comma-separated, as text `config_from_args` splits."""
    value = getattr(defaults, name)
    if isinstance(value, tuple):
        value = ",".join(map(str, value))
    if value is not None and "type" not in options and "choices" not in options:
        options["type"] = type(value)
    parser.add_argument(
        f"--{name.replace('_', '-')}",
        default=value,
        help=f"{help} (default {value})" if help and value != "" else help or f"default {value}",
        **options,
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


def config_from_args(config: type[Config], args: argparse.Namespace, **given: Any) -> Config:
    """A bench's config from its flags: each field from the argument of the same name, unless
    `given` sets it (a flag named otherwise, or one parsed first); a field with neither keeps
    its default. A tuple field given as comma-separated text (`add_config_flag`) is split: into
    counts of at least 1 where its default holds numbers, else into names."""
    named = {}
    for field in dataclasses.fields(config):
        if field.name in given or not hasattr(args, field.name):
            continue
        value = getattr(args, field.name)
        if isinstance(value, str) and isinstance(field.default, tuple):
            flag = f"--{field.name.replace('_', '-')}"
            numbers = bool(field.default) and isinstance(field.default[0], int)
            value = tuple(
                agent_counts(value, flag, 1) if numbers else filter(None, value.split(","))
            )
        named[field.name] = value
    return config(**named, **given)


def progress() -> Callable[[str], None]:
    """Where a bench reports its progress: timestamped lines on stderr (tables go to stdout)."""
    from rich.console import Console

    return Console(stderr=True).log


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
    plot: Callable[[dict[str, Any], Path], None] | None = None,
) -> None:
    """Print a bench's table, write its JSON to --json and, for a bench with a `plot` (and so a
    --plot option: `add_bench_options`), draw it to --plot if given."""
    from kmesh.bench.common import report_console

    print_report(result, report_console())
    write_json(args.json, result)
    if plot is not None and args.plot:
        plot(result, Path(args.plot))
