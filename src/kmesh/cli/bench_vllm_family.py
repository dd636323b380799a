"""`kmesh bench vllm-family`: one family over several vLLM instances sharing a store, against
vanilla vLLM (bench/vllm_family/run.py)."""

import argparse

from kmesh.cli.bench_common import add_bench_options, config_from_args, emit_report, progress
from kmesh.cli.common import Commands
from kmesh.extras import VLLM, require


def _bench_vllm_family(args: argparse.Namespace) -> None:
    require(VLLM, "kmesh bench vllm-family")
    from kmesh.bench.vllm_family.run import FamilyBenchConfig, print_family, run_family_bench

    config = config_from_args(FamilyBenchConfig, args)
    log = progress()
    report = run_family_bench(config, progress=log)
    emit_report(args, report, print_family)


def register(benches: Commands) -> None:
    family = benches.add_parser(
        "vllm-family",
        help="one family over several vLLM instances sharing a store vs vanilla vLLM",
    )
    family.add_argument("--instances", type=int, default=2, help="vLLM processes")
    family.add_argument("--requests", type=int, default=8, help="family members, round-robin")
    family.add_argument("--trunk-tokens", type=int, default=2048, help="shared trunk length")
    family.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per request")
    add_bench_options(family, _bench_vllm_family, engine="vllm")
