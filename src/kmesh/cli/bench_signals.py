"""`kmesh bench signals`: how well signals seen at recovery time (the recovered state's top-1
margin, the gate's deviation) predict a diverging output, fitted on some All-Gather bench JSONs
and scored on others (bench/signals/divergence.py); with --check-layers instead, how well the key
deviation at each check layer picks the reused rows to recompute, on a model
(bench/signals/check_layer.py)."""

import argparse
import json
from pathlib import Path
from typing import Any

from kmesh.cli.bench_common import add_bench_options, emit_report, progress
from kmesh.cli.common import Commands, add_model_option
from kmesh.errors import InvalidRequestError

APPROXIMATE = ("per_request", "collective")


def _reports(flag: str, text: str) -> dict[str, dict[str, Any]]:
    reports = {}
    for part in filter(None, text.split(",")):
        try:
            report = json.loads(Path(part).read_text())
        except (OSError, ValueError) as error:
            raise InvalidRequestError(f"{flag}: cannot read {part!r} as JSON: {error}") from None
        if not isinstance(report, dict) or not isinstance(report.get("strategies"), dict):
            raise InvalidRequestError(f"{flag}: {part!r} is not a `kmesh bench allgather` report")
        reports[part] = report
    if not reports:
        raise InvalidRequestError(f"{flag} takes bench JSONs separated by commas")
    return reports


def _numbers(flag: str, text: str, low: int, high: int | None = None) -> list[int]:
    """Comma-separated integers and ranges a-b (inclusive), each in [low, high]."""
    found: list[int] = []
    try:
        for part in filter(None, text.split(",")):
            first, _, last = part.partition("-")
            found += range(int(first), int(last or first) + 1)
    except ValueError:
        raise InvalidRequestError(
            f"{flag} takes numbers and ranges like 1,2,5-8; got {text!r}"
        ) from None
    if not found or any(n < low or (high is not None and n > high) for n in found):
        bound = f"from {low}" if high is None else f"from {low} to {high}"
        raise InvalidRequestError(f"{flag} takes numbers {bound}; got {text!r}")
    return list(dict.fromkeys(found))


def _bench_signals(args: argparse.Namespace) -> None:
    if args.check_layers is not None:
        _bench_check_layers(args)
        return
    if args.fit is None or args.test is None:
        raise InvalidRequestError("give --fit and --test (bench JSONs), or --check-layers")
    from kmesh.bench.signals.divergence import print_signals, signals_report

    fit_on, test_on = _reports("--fit", args.fit), _reports("--test", args.test)
    if {Path(p).resolve() for p in fit_on} & {Path(p).resolve() for p in test_on}:
        raise InvalidRequestError("--fit and --test must name different files")
    strategies = [s for s in args.strategies.split(",") if s]
    if not strategies or set(strategies) - set(APPROXIMATE):
        raise InvalidRequestError(f"--strategies takes some of {', '.join(APPROXIMATE)}")
    try:
        report = signals_report(fit_on, test_on, strategies)
    except ValueError as error:
        raise InvalidRequestError(str(error)) from None
    emit_report(args, report, print_signals)


def _bench_check_layers(args: argparse.Namespace) -> None:
    if args.fit is not None or args.test is not None:
        raise InvalidRequestError("--check-layers measures a model: it takes no --fit or --test")
    if not 0.0 < args.ratio < 1.0:
        raise InvalidRequestError(f"--ratio must be in (0, 1), got {args.ratio}")
    if args.segments < 1:
        raise InvalidRequestError(f"--segments must be at least 1, got {args.segments}")
    try:
        shortest, longest = (int(n) for n in args.lengths.split(","))
    except ValueError:
        shortest = longest = 0
    if not 1 <= shortest <= longest:
        raise InvalidRequestError(
            f"--lengths takes the shortest and longest segment, like 150,400; got {args.lengths!r}"
        )
    from kmesh.bench.signals.check_layer import check_layer_report, print_check_layers
    from kmesh.compute.loader import load_model

    model = load_model(args.model)
    last = model.config.num_layers - 2
    layers = (
        list(range(1, last + 1))
        if args.check_layers == "all"
        else _numbers("--check-layers", args.check_layers, 1, last)
    )
    seeds = _numbers("--seeds", args.seeds, 0)
    report = check_layer_report(
        model.executor,
        model.tokenizer,
        seeds,
        layers,
        args.ratio,
        args.segments,
        (shortest, longest),
        progress(),
    )
    report["model"] = args.model or "embedded"
    emit_report(args, report, print_check_layers)


def register(benches: Commands) -> None:
    signals = benches.add_parser(
        "signals", help="do recovery's margin and deviation predict a diverging output?"
    )
    signals.add_argument("--fit", help="`kmesh bench allgather` JSONs to fit the threshold on")
    signals.add_argument("--test", help="other such JSONs to score it on")
    signals.add_argument("--strategies", default=",".join(APPROXIMATE), help="default: both")
    signals.add_argument(
        "--check-layers",
        default=None,
        help="instead of --fit/--test: measure these check layers (like 1-6,11, or all: 1 to "
        "the last but one) on --model's All-Gather-like prompts",
    )
    signals.add_argument("--seeds", default="1,2,3", help="with --check-layers: one prompt each")
    signals.add_argument("--segments", type=int, default=5, help="reused segments per prompt")
    signals.add_argument("--lengths", default="150,400", help="their shortest and longest")
    signals.add_argument("--ratio", type=float, default=0.2, help="share of them recomputed")
    add_model_option(signals)
    add_bench_options(signals, _bench_signals, model=False)
