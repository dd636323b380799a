"""The multi-LoRA commands: `kmesh adapters prepare` and `kmesh bench lora`."""

import argparse
from pathlib import Path
from typing import Any

from kmesh.errors import InvalidRequestError

KINDS = ("lora", "activated")


def _prepare(args: argparse.Namespace) -> None:
    from kmesh.adapters.prepare import ensure_adapters

    if args.count < 1:
        raise InvalidRequestError(f"--count must be at least 1, got {args.count}")
    for kind in KINDS if args.kind == "all" else (args.kind,):
        for path in ensure_adapters(kind, args.count):
            print(path)


def _bench_lora(args: argparse.Namespace) -> None:
    from rich.console import Console

    from kmesh.adapters.prepare import ensure_adapters
    from kmesh.bench.lora import LoraBench, LoraBenchConfig, run_lora_bench
    from kmesh.bench.lora_report import plot, print_report
    from kmesh.cli import agent_counts, write_json
    from kmesh.compute.loader import load_model
    from kmesh.compute.lora import load_adapter
    from kmesh.recovery.adapter_residual import ResidualConfig

    agents = tuple(agent_counts(args.agents, "--agents", 1))
    if args.context_tokens < 64:
        raise InvalidRequestError(
            f"--context-tokens must be at least 64, got {args.context_tokens}"
        )
    console = Console(stderr=True)
    model = load_model(args.model)
    if args.context_tokens + 128 > model.config.max_position:
        raise InvalidRequestError(
            f"--context-tokens {args.context_tokens} leaves no room in the model's context "
            f"({model.config.max_position} tokens)"
        )
    console.log(f"preparing {max(agents)} adapters of each kind (trained once, then cached)")
    plain_dirs = ensure_adapters("lora", max(agents))
    activated_dirs = ensure_adapters("activated", max(agents))
    plain = [load_adapter(path, model.executor.dtype) for path in plain_dirs]
    activated = [load_adapter(path, model.executor.dtype) for path in activated_dirs]
    cfg = LoraBenchConfig(
        agents=agents,
        context_tokens=args.context_tokens,
        seed=args.seed,
        residual=ResidualConfig(args.check_tokens, args.max_deviation),
    )
    console.log(f"the shared context ({cfg.context_tokens} tokens: written once, then cached)")
    bench = LoraBench(model, plain, activated, cfg)
    if args.engine == "vllm":
        from kmesh.bench.lora_vllm import run_vllm_lora_bench

        result = run_vllm_lora_bench(
            bench, plain_dirs, activated_dirs, args.model, progress=console.log
        )
    else:
        result = run_lora_bench(bench, progress=console.log)
    print_report(result, Console())
    write_json(args.json, result)
    picture = Path(args.json).with_suffix(".png")
    plot(result, picture)
    print(f"wrote {picture}")


def add_commands(commands: Any, benches: Any) -> None:
    """Register `adapters prepare` under `commands` and `lora` under `benches`."""
    from kmesh.recovery.adapter_residual import DEFAULT_CHECK_TOKENS, DEFAULT_MAX_DEVIATION

    adapters = commands.add_parser("adapters", help="LoRA adapters for the embedded model")
    adapter_commands = adapters.add_subparsers(dest="adapters_command", required=True)
    prepare = adapter_commands.add_parser(
        "prepare", help="train (once, deterministically) and cache persona adapters"
    )
    prepare.add_argument("--kind", choices=[*KINDS, "all"], default="all")
    prepare.add_argument("--count", type=int, default=4, help="adapters of each kind")
    prepare.set_defaults(func=_prepare)

    lora = benches.add_parser(
        "lora",
        help="agents with their own adapters over one context: exact vs activated vs residual",
    )
    lora.add_argument("--agents", default="4,8,16", help="agent counts, comma-separated")
    lora.add_argument("--context-tokens", type=int, default=2048)
    lora.add_argument("--engine", choices=["reference", "vllm"], default="reference")
    lora.add_argument("--seed", type=int, default=0, help="the shared context's seed")
    lora.add_argument(
        "--check-tokens",
        type=int,
        default=DEFAULT_CHECK_TOKENS,
        help="residual: context tokens the gate recomputes under the adapter",
    )
    lora.add_argument(
        "--max-deviation",
        type=float,
        default=DEFAULT_MAX_DEVIATION,
        help="residual: the gate's bound on the check tokens' relative KV deviation",
    )
    lora.add_argument("--json", required=True, help="where to write the result (and a .png)")
    lora.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    lora.set_defaults(func=_bench_lora)
