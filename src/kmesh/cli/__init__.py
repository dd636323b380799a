"""The `kmesh` command line.

One module per command (group) registers its parser and handler; this module only assembles them
in the order the help lists them, and runs one. A handler raises KMeshError for bad input: it is
printed as one line (`kmesh: error: ...`) and the exit status is 2. So is a missing extra: only
the commands that need vLLM or Mooncake import them, and they check first (kmesh/extras.py).
`kmesh vllm ...` is handed to vLLM's own command line before parsing (kmesh/cli/vllm.py). A
bench stopped by SIGTERM exits through its cleanup, so the servers and stores it started are
stopped too.
"""

import argparse
import signal
import sys
from collections.abc import Sequence

from kmesh.cli import (
    adapters,
    bench_agents,
    bench_allgather,
    bench_calibrate,
    bench_capacity,
    bench_council,
    bench_fork,
    bench_load,
    bench_lora,
    bench_restore,
    bench_round,
    bench_signals,
    bench_tasks,
    bench_vllm_family,
    demo,
    generate,
    model,
    serve,
    store,
    vllm,
    workload,
)
from kmesh.errors import KMeshError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kmesh", description="KMesh: keyed inference state shared across related requests."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    generate.register(commands)
    model.register(commands)
    demo.register(commands)
    workload.register(commands)
    bench = commands.add_parser("bench", help="benchmarks: print a table, write JSON")
    benches = bench.add_subparsers(dest="bench_command", required=True)
    for command in (
        bench_fork,
        bench_allgather,
        bench_restore,
        bench_round,
        bench_vllm_family,
        bench_lora,
        bench_council,
        bench_load,
        bench_capacity,
        bench_agents,
        bench_signals,
        bench_calibrate,
        bench_tasks,
    ):
        command.register(benches)
    adapters.register(commands)
    vllm.register(commands)
    serve.register(commands)
    store.register(commands)
    return parser


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["vllm"]:  # vLLM's own command line, its arguments untouched
            return vllm.run_vllm(argv[1:])
        args = build_parser().parse_args(argv)
        if args.command == "bench":  # SIGTERM unwinds, so a bench stops the servers it started
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
        args.func(args)
    except KMeshError as error:
        print(f"kmesh: error: {error}", file=sys.stderr)
        return 2
    return 0
