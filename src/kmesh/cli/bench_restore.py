"""`kmesh bench restore`: restoring keyed state from a store vs recomputing it; singleflight
(bench/restore/run.py)."""

import argparse

from kmesh.cli.bench_common import add_bench_options, emit_report, progress
from kmesh.cli.common import Commands
from kmesh.errors import InvalidRequestError
from kmesh.extras import MOONCAKE, require


def _bench_restore(args: argparse.Namespace) -> None:
    from kmesh.bench.restore.run import print_restore, run_restore_bench

    try:
        sizes = [int(part) for part in args.tokens.split(",")]
    except ValueError:
        raise InvalidRequestError(
            f"--tokens takes sizes separated by commas, like 1024,4096; got {args.tokens!r}"
        ) from None
    if any(n < 16 for n in sizes) or args.concurrency < 1:
        raise InvalidRequestError("--tokens sizes must be >= 16 and --concurrency >= 1")
    tiers = args.tiers.split(",")
    if tiers not in (["local"], ["local", "remote"]):
        raise InvalidRequestError(f"--tiers takes local or local,remote; got {args.tiers!r}")
    if "remote" in tiers:
        require(MOONCAKE, "kmesh bench restore --tiers local,remote")
    log = progress()
    report = run_restore_bench(args.model, sizes, args.concurrency, log, tiers)
    emit_report(args, report, print_restore)


def register(benches: Commands) -> None:
    restore = benches.add_parser(
        "restore", help="restore keyed state from a store vs recompute it; singleflight"
    )
    restore.add_argument("--tokens", default="1024,4096,16384", help="prompt sizes")
    restore.add_argument(
        "--concurrency", type=int, default=8, help="engine processes asking for one prompt"
    )
    restore.add_argument(
        "--tiers",
        default="local",
        help="local (one store), or local,remote: also two stores in front of a Mooncake Store "
        "master, restoring one machine's blocks on the other (started on loopback ports)",
    )
    add_bench_options(restore, _bench_restore)
