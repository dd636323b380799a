"""`kmesh bench lora`: agents with their own adapters over one context, exact vs activated vs
residual (bench/lora/run.py; bench/lora/vllm.py with --engine vllm)."""

import argparse
from pathlib import Path

from kmesh.cli.bench_common import agent_counts, config_from_args, progress, write_json
from kmesh.cli.common import Commands, add_model_option, check_model
from kmesh.errors import InvalidRequestError
from kmesh.extras import VLLM, require


def _bench_lora(args: argparse.Namespace) -> None:
    if args.engine == "vllm":
        require(VLLM, "kmesh bench lora --engine vllm")
    check_model(args.model, args.engine)
    from kmesh.adapters.prepare import ensure_adapters
    from kmesh.bench.common import report_console
    from kmesh.bench.lora.report import plot, print_report
    from kmesh.bench.lora.run import LoraBench, LoraBenchConfig, run_lora_bench
    from kmesh.compute.loader import load_model
    from kmesh.compute.lora import load_adapter
    from kmesh.recovery.adapter_residual import ResidualConfig

    cfg = config_from_args(
        LoraBenchConfig,
        args,
        agents=tuple(agent_counts(args.agents, "--agents", 1)),
        residual=ResidualConfig(args.check_tokens, args.max_deviation),
    )
    log = progress()
    model = load_model(args.model)
    if args.context_tokens + 128 > model.config.max_position:
        raise InvalidRequestError(
            f"--context-tokens {args.context_tokens} leaves no room in the model's context "
            f"({model.config.max_position} tokens)"
        )
    adapters = max(cfg.agents)
    log(f"preparing {adapters} adapters of each kind (trained once, then cached)")
    plain_dirs = ensure_adapters("lora", adapters)
    activated_dirs = ensure_adapters("activated", adapters)
    plain = [load_adapter(path, model.executor.dtype) for path in plain_dirs]
    activated = [load_adapter(path, model.executor.dtype) for path in activated_dirs]
    log(f"the shared context ({cfg.context_tokens} tokens: written once, then cached)")
    bench = LoraBench(model, plain, activated, cfg)
    if args.engine == "vllm":
        from kmesh.bench.lora.vllm import run_vllm_lora_bench

        result = run_vllm_lora_bench(bench, plain_dirs, activated_dirs, args.model, progress=log)
    else:
        result = run_lora_bench(bench, progress=log)
    print_report(result, report_console())
    write_json(args.json, result)
    picture = Path(args.json).with_suffix(".png")
    plot(result, picture)
    print(f"wrote {picture}")


def register(benches: Commands) -> None:
    from kmesh.recovery.residual_defaults import DEFAULT_CHECK_TOKENS, DEFAULT_MAX_DEVIATION

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
    add_model_option(lora)
    lora.set_defaults(func=_bench_lora)
