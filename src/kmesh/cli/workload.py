"""`kmesh workload allgather`: generate an All-Gather council trace (workloads/allgather.py)."""

import argparse
from pathlib import Path

from kmesh.cli.common import Commands, add_model_option


def _workload_allgather(args: argparse.Namespace) -> None:
    from rich.console import Console

    from kmesh.compute.loader import load_model
    from kmesh.engine.engine import Engine
    from kmesh.workloads.allgather import AllGatherConfig, generate_trace
    from kmesh.workloads.trace import save_trace

    cfg = AllGatherConfig(args.agents, args.rounds, args.order, args.seed, args.output_tokens)
    console = Console(stderr=True)
    model = load_model(args.model)
    engine = Engine(model.executor, model.fingerprint)
    turns = generate_trace(cfg, engine, model.tokenizer, progress=console.log)
    save_trace(Path(args.out), cfg, model.fingerprint, turns)
    last = [t for t in turns if t.round == cfg.rounds - 1]
    longest = max(len(t.prompt.token_ids) for t in last)
    print(
        f"wrote {args.out}: {len(turns)} agent turns; round {cfg.rounds} prompts up to "
        f"{longest} tokens in {max(len(t.prompt.segments) for t in last)} segments"
    )


def register(commands: Commands) -> None:
    workload = commands.add_parser("workload", help="generate controlled workloads (traces)")
    workloads = workload.add_subparsers(dest="workload_command", required=True)
    allgather = workloads.add_parser(
        "allgather", help="an All-Gather council: N agents, R rounds, every agent sees all outputs"
    )
    allgather.add_argument("--agents", type=int, default=8)
    allgather.add_argument("--rounds", type=int, default=3)
    allgather.add_argument("--order", choices=["same", "rotate", "shuffle"], default="shuffle")
    allgather.add_argument("--seed", type=int, default=0)
    allgather.add_argument("--output-tokens", type=int, default=48, help="tokens per agent output")
    allgather.add_argument("--out", required=True, help="trace.jsonl to write")
    add_model_option(allgather)
    allgather.set_defaults(func=_workload_allgather)
