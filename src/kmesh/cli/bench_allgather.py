"""`kmesh bench allgather`: an All-Gather trace prefilled four ways (full, prefix, per-request,
collective recovery) on the reference engine (bench/allgather/run.py) or vLLM with KMeshConnector
(bench/allgather/vllm.py: it replays a trace and takes no --scale or --report)."""

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from kmesh.cli.bench_common import add_bench_options, agent_counts, progress, write_json
from kmesh.cli.common import Commands
from kmesh.errors import InvalidRequestError
from kmesh.extras import VLLM, require


def _bench_allgather(args: argparse.Namespace) -> None:
    if args.engine == "vllm":
        require(VLLM, "kmesh bench allgather --engine vllm")
    from kmesh.bench.allgather.closed_loop import Loops, plain_loops, reference_closed_loop
    from kmesh.bench.allgather.config import RECOVERY_FIELDS, AllGatherBenchConfig
    from kmesh.bench.allgather.report import write_report
    from kmesh.bench.allgather.run import run_allgather_bench
    from kmesh.compute.loader import load_model
    from kmesh.engine.engine import Engine
    from kmesh.workloads.allgather import AllGatherConfig, generate_trace
    from kmesh.workloads.trace import load_trace

    given = {
        name: getattr(args, name) for name in RECOVERY_FIELDS if getattr(args, name) is not None
    }
    if args.no_gate:
        if "gate" in given:
            raise InvalidRequestError("--gate and --no-gate cannot be combined")
        given["gate"] = None
    cfg = AllGatherBenchConfig(**given)
    scale = agent_counts(args.scale)
    workload = None
    if args.trace is not None:
        fixed = [f"--{n}" for n in ("agents", "rounds", "order") if getattr(args, n) is not None]
        if fixed:
            raise InvalidRequestError(
                f"{', '.join(fixed)} cannot be combined with --trace: the trace fixes the workload"
            )
        workload, trace_model, turns = load_trace(Path(args.trace))
        if not isinstance(workload, AllGatherConfig):
            raise InvalidRequestError(f"trace {args.trace!r} is not an All-Gather trace")
    else:
        workload = AllGatherConfig(
            args.agents or 8, args.rounds or 3, args.order or "shuffle", args.seed
        )
    if args.engine != "vllm" and args.block_size is not None:
        raise InvalidRequestError("--block-size is vLLM's page size: it needs --engine vllm")
    if args.plot is not None and not args.frontier:
        raise InvalidRequestError("--plot draws the frontier: it needs --frontier")
    if args.engine == "vllm":
        trace = (trace_model, turns) if args.trace is not None else None
        _bench_allgather_vllm(args, cfg, workload, trace)
        return
    log = progress()
    model = load_model(args.model)
    engine = Engine(model.executor, model.fingerprint)
    if args.trace is not None:
        if trace_model != model.fingerprint:
            raise InvalidRequestError(
                f"trace {args.trace!r} was generated with another model (fingerprint "
                f"{trace_model[:12]}, this model is {model.fingerprint[:12]}); regenerate it with "
                "`kmesh workload allgather`"
            )
    else:
        log(f"generating the workload: {workload.agents} agents, {workload.rounds} rounds")
        turns = generate_trace(workload, engine, model.tokenizer, progress=log)
    others = []
    for agents in scale:
        if agents == workload.agents:
            others.append(turns)
            continue
        log(f"generating the workload for --scale: {agents} agents")
        other = replace(workload, agents=agents)
        others.append(generate_trace(other, engine, model.tokenizer, progress=log))

    def closed_loops(loops: Loops) -> dict[str, dict[str, list[float]]]:
        engine = Engine(model.executor, model.fingerprint, kv_cache_tokens=1 << 15)
        return reference_closed_loop(engine, model.tokenizer, workload, loops, log)

    report = run_allgather_bench(
        model.executor,
        model.fingerprint,
        turns,
        cfg,
        workload,
        args.sweep,
        others,
        progress=log,
        frontier=closed_loops if args.frontier else None,
    )
    if args.closed_loop:
        for name, loop in closed_loops(plain_loops(cfg)).items():
            report["strategies"][name]["closed_loop"] = loop
    _emit(args, report)
    if args.report is not None:
        print(f"wrote {write_report(report, Path(args.report))}")


def _emit(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """The table, the JSON and, with --plot, the frontier's plot."""
    from kmesh.bench.allgather.frontier_report import plot_frontier
    from kmesh.bench.allgather.report import print_table
    from kmesh.bench.common import report_console

    print_table(report, report_console())
    write_json(args.json, report)
    if args.plot is not None:
        plot_frontier(report, Path(args.plot))
        print(f"wrote {args.plot}")


def _bench_allgather_vllm(
    args: argparse.Namespace, cfg: Any, workload: Any, trace: tuple[str, Any] | None
) -> None:
    from kmesh.bench.allgather.vllm import run_vllm_allgather_bench
    from kmesh.compute.fingerprint import model_fingerprint
    from kmesh.compute.loader import resolve_model_dir

    unsupported = [f"--{n}" for n in ("scale", "report") if getattr(args, n)]
    if trace is None or unsupported:
        raise InvalidRequestError(
            "--engine vllm replays a trace (give --trace, made by `kmesh workload allgather`) "
            "and takes no --scale or --report"
        )
    trace_model, turns = trace
    fingerprint = model_fingerprint(str(resolve_model_dir(args.model)))
    if trace_model != fingerprint:
        raise InvalidRequestError(
            f"trace {args.trace!r} was generated with another model (fingerprint "
            f"{trace_model[:12]}, this model is {fingerprint[:12]}); regenerate it with "
            "`kmesh workload allgather`"
        )
    log = progress()
    report = run_vllm_allgather_bench(
        turns,
        cfg,
        workload,
        args.model,
        args.block_size,
        args.sweep,
        args.closed_loop,
        args.frontier,
        progress=log,
    )
    _emit(args, report)


def register(benches: Commands) -> None:
    gather = benches.add_parser(
        "allgather",
        help="All-Gather rounds: full vs prefix vs per-request vs collective recovery",
    )
    gather.add_argument("--trace", default=None, help="replay a `kmesh workload allgather` trace")
    gather.add_argument("--agents", type=int, default=None, help="without --trace (default 8)")
    gather.add_argument("--rounds", type=int, default=None, help="without --trace (default 3)")
    gather.add_argument(
        "--order", choices=["same", "rotate", "shuffle"], default=None, help="default shuffle"
    )
    gather.add_argument("--seed", type=int, default=0, help="workload seed (without --trace)")
    gather.add_argument(
        "--policy",
        default=None,
        help="recovery policy: none, full, kv_deviation, first_k or random (default kv_deviation)",
    )
    gather.add_argument(
        "--master",
        choices=["sibling", "common"],
        default=None,
        help="collective: a round's master is its first agent's own exact KV (sibling, default) "
        "or its outputs recovered after the agents' common context (common)",
    )
    gather.add_argument(
        "--recompute-ratio",
        type=float,
        default=None,
        help="per_request: share of each agent's reused tokens recomputed (default 0.3)",
    )
    gather.add_argument(
        "--shared-ratio",
        type=float,
        default=None,
        help="collective: share of the round's outputs recomputed once, in the shared context "
        "(default 1.0: all)",
    )
    gather.add_argument(
        "--agent-ratio",
        type=float,
        default=None,
        help="collective: share of each agent's reused blocks recomputed (default 0)",
    )
    gather.add_argument(
        "--check-layer",
        type=int,
        default=None,
        help="kv_deviation's and the gate's (default: the model's; 1 without sliding windows)",
    )
    gather.add_argument(
        "--gate",
        type=float,
        default=None,
        help="quality gate: mean relative key deviation at the check layer above which a region "
        "is fully recomputed (default 0.1)",
    )
    gather.add_argument(
        "--gate-sample",
        type=float,
        default=None,
        help="share of each region's reused tokens the gate checks when no policy scores them "
        "all (collective at --agent-ratio 0; default 0.125; at most 64 a region below 1)",
    )
    gather.add_argument("--no-gate", action="store_true", help="no quality gate")
    gather.add_argument(
        "--quality",
        default=None,
        help="per_request and collective by a quality target (exact, greedy or kl:<x>) in "
        "place of their knobs: each runs at the setting it resolves to on this model, or "
        "exactly (kmesh/recovery/quality.py)",
    )
    gather.add_argument(
        "--sweep",
        action="store_true",
        help="also measure quality vs ratio (reference: every policy; vllm: collective's agent "
        "ratio for both master choices)",
    )
    gather.add_argument("--scale", default=None, help="also run these agent counts, e.g. 4,8,16")
    gather.add_argument(
        "--closed-loop",
        action="store_true",
        help="also run each strategy's council on its own generated outputs and compare them "
        "with full prefill's (bench/allgather/closed_loop.py)",
    )
    gather.add_argument(
        "--frontier",
        action="store_true",
        help="also sweep each approximate strategy over its budget knobs, open and closed loop, "
        "and report each one's frontier of computed tokens against outputs identical to full "
        "prefill's (bench/allgather/frontier.py; 13 closed loops more)",
    )
    gather.add_argument("--report", default=None, help="folder for report.md and plots")
    gather.add_argument(
        "--engine",
        choices=["reference", "vllm"],
        default="reference",
        help="reference: KMesh's own engine; vllm: vLLM with KMeshConnector (needs --trace)",
    )
    gather.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="--engine vllm: vLLM's page size in tokens (a multiple of 32; default "
        "kmesh.vllm.config.DEFAULT_BLOCK_SIZE)",
    )
    add_bench_options(gather, _bench_allgather, plot="the frontier (with --frontier)")
