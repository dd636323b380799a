"""`kmesh bench calibrate`: the frontier sweeps of `kmesh bench allgather --frontier` on several
traces, reduced to each setting's worst figures over them
(bench/allgather/frontier.py::calibration_rows): the table kmesh/recovery/quality.py's
calibrations are copied from."""

import argparse
import json
from pathlib import Path

from kmesh.cli.bench_common import add_bench_options, emit_report
from kmesh.cli.common import Commands
from kmesh.errors import InvalidRequestError


def _bench_calibrate(args: argparse.Namespace) -> None:
    from kmesh.bench.allgather.frontier import calibration_rows
    from kmesh.bench.allgather.frontier_report import print_calibration

    frontiers, models = [], set()
    for part in filter(None, args.frontiers.split(",")):
        try:
            report = json.loads(Path(part).read_text())
        except (OSError, ValueError) as error:
            raise InvalidRequestError(f"--frontiers: cannot read {part!r}: {error}") from None
        if not isinstance(report, dict) or "frontier" not in report:
            raise InvalidRequestError(
                f"--frontiers: {part!r} has no frontier (run `kmesh bench allgather --frontier`)"
            )
        frontiers.append(report["frontier"])
        models.add(report["config"]["model"])
    if len(frontiers) < 2 or len(models) != 1:
        raise InvalidRequestError(
            "--frontiers takes two or more frontier JSONs of one model, separated by commas"
        )
    result = {
        "model": models.pop(),
        "frontiers": args.frontiers.split(","),
        "settings": calibration_rows(frontiers),
    }
    emit_report(args, result, print_calibration)


def register(benches: Commands) -> None:
    calibrate = benches.add_parser(
        "calibrate", help="frontier sweeps on several traces -> each setting's worst figures"
    )
    calibrate.add_argument(
        "--frontiers",
        required=True,
        help="`kmesh bench allgather --frontier` JSONs, comma-separated",
    )
    add_bench_options(calibrate, _bench_calibrate, model=False)
