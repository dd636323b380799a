"""`kmesh bench signals`: how well signals seen at recovery time (the recovered state's top-1
margin, the gate's deviation) predict a diverging output, fitted on some All-Gather bench JSONs
and scored on others (bench/signals/divergence.py)."""

import argparse
import json
from pathlib import Path
from typing import Any

from kmesh.cli.bench_common import add_bench_options, emit_report
from kmesh.cli.common import Commands
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


def _bench_signals(args: argparse.Namespace) -> None:
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


def register(benches: Commands) -> None:
    signals = benches.add_parser(
        "signals", help="do recovery's margin and deviation predict a diverging output?"
    )
    signals.add_argument(
        "--fit", required=True, help="`kmesh bench allgather` JSONs to fit the threshold on"
    )
    signals.add_argument("--test", required=True, help="other such JSONs to score it on")
    signals.add_argument("--strategies", default=",".join(APPROXIMATE), help="default: both")
    add_bench_options(signals, _bench_signals, model=False)
