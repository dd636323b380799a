"""The `kmesh` command line."""

import argparse
import json
import logging
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kmesh import cli_council, cli_load, cli_lora
from kmesh.errors import InvalidRequestError, KMeshError


def _generate(args: argparse.Namespace) -> None:
    from kmesh.engine.llm import LLM, check_prompt_text
    from kmesh.engine.request import SamplingParams

    check_prompt_text(args.prompt)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    _check_store(args.store)
    llm = LLM(args.model, store=args.store)
    [completion] = llm.generate([args.prompt], params, chat=args.chat, tenant_salt=args.tenant_salt)
    out = completion.output
    if args.json:
        print(
            json.dumps(
                {
                    "text": completion.text,
                    "token_ids": list(out.output_ids),
                    "prompt_token_ids": list(out.prompt_ids),
                    "finish_reason": out.finish_reason,
                    "stats": asdict(out.stats),
                }
            )
        )
    else:
        print(completion.text)


def _check_store(store: str | None) -> None:
    if store is not None and not Path(store).exists():
        raise InvalidRequestError(
            f"no store socket at {store!r}: start one with `kmesh store serve --socket PATH`"
        )


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from kmesh.serve.app import create_app
    from kmesh.serve.backend import Backend

    _check_store(args.store)
    reuse_messages = None
    if args.reuse_messages:
        from kmesh.serve.jobs import REUSE_MESSAGES

        reuse_messages = REUSE_MESSAGES
        if args.reuse_ratio is not None:
            if not 0 <= args.reuse_ratio <= 1:
                raise InvalidRequestError(
                    f"--reuse-ratio must be in [0, 1], got {args.reuse_ratio}"
                )
            reuse_messages = REUSE_MESSAGES.model_copy(update={"ratio": args.reuse_ratio})
    elif args.reuse_ratio is not None:
        raise InvalidRequestError("--reuse-ratio needs --reuse-messages")
    api_keys = None
    if args.api_keys is not None:
        from kmesh.state.tenants import load_api_keys

        api_keys = load_api_keys(args.api_keys)
    recovery_bytes = None
    if args.recovery_bytes is not None:
        from kmesh.store.server import parse_size

        recovery_bytes = parse_size(args.recovery_bytes, "--recovery-bytes")
    listener = _listen(args.host, args.port)
    backend: Backend
    if args.engine == "vllm":
        from kmesh.serve.vllm_backend import VLLMBackend

        backend = VLLMBackend(args.model, store=args.store, recovery_bytes=recovery_bytes)
        print("kmesh serve: starting vLLM (about a minute on 2 cores)...", flush=True)
    else:
        from kmesh.serve.reference_backend import ReferenceBackend

        options = {} if recovery_bytes is None else {"recovery_bytes": recovery_bytes}
        backend = ReferenceBackend(args.model, store=args.store, **options)
    port = listener.getsockname()[1]

    def ready() -> None:
        print(
            f"kmesh serve: {backend.engine} engine on http://{args.host}:{port} "
            f"(model {backend.model_id})",
            flush=True,
        )

    access = logging.getLogger("kmesh.serve")  # the access lines and ignored fields, on stderr
    access.setLevel(logging.INFO)
    access.addHandler(logging.StreamHandler())
    app = create_app(
        backend,
        on_ready=ready,
        strict_fields=args.strict_fields,
        reuse_messages=reuse_messages,
        api_keys=api_keys,
    )
    config = uvicorn.Config(app, log_level="warning")
    uvicorn.Server(config).run(sockets=[listener])


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket (bound before the model loads, so a taken port fails at once)."""
    if not 0 <= port <= 65535:
        raise InvalidRequestError(f"--port must be in 0..65535 (0: any free port), got {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as error:
        raise InvalidRequestError(
            f"unknown --host {host!r} ({error.strerror}): give an address like 127.0.0.1"
        ) from None
    try:
        return socket.create_server((host, port), family=family)
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise InvalidRequestError(
            f"cannot listen on {host}:{port} ({reason}): pick another --port or --host"
        ) from None


def _model_info(args: argparse.Namespace) -> None:
    from kmesh.compute.embedded import cache_dir
    from kmesh.compute.loader import load_model

    model = load_model(args.model)
    config = asdict(model.config)
    info = {
        "path": str(model.path),
        "cache_dir": str(cache_dir()),
        "fingerprint": model.fingerprint,
        "dtype": str(model.executor.dtype).removeprefix("torch."),
        "has_chat_template": bool(getattr(model.tokenizer, "chat_template", None)),
    }
    if args.json:
        print(json.dumps({**info, "config": config}))
        return
    for key, value in info.items():
        print(f"{key:18} {value}")
    print("config")
    for key, value in config.items():
        print(f"  {key:20} {value}")


def _demo(args: argparse.Namespace) -> None:
    from kmesh.demo import run_demo

    run_demo(args.model)


def _bench_fork(args: argparse.Namespace) -> None:
    from rich.console import Console

    from kmesh.bench.fork import ForkBenchConfig, print_report, run_fork_bench
    from kmesh.compute.loader import load_model

    for name in ("branches", "trunk_tokens", "branch_tokens"):
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be at least 1")
    if args.mode == "cot" and args.reasoning_tokens < 1:
        raise InvalidRequestError("--reasoning-tokens must be at least 1 for --mode cot")
    console = Console(stderr=True)
    model = load_model(args.model)
    cfg = ForkBenchConfig(
        mode=args.mode,
        branches=args.branches,
        trunk_tokens=args.trunk_tokens,
        branch_tokens=args.branch_tokens,
        reasoning_tokens=args.reasoning_tokens,
        seed=args.seed,
    )
    context = cfg.trunk_tokens + cfg.reasoning_tokens + 2 * cfg.branch_tokens
    if context > model.config.max_position:
        raise InvalidRequestError(
            f"trunk + reasoning + branch tokens ({context}) exceed the model's context "
            f"({model.config.max_position})"
        )
    if args.engine == "vllm":
        from kmesh.bench.fork_vllm import print_vllm_report, run_vllm_fork_bench

        report = run_vllm_fork_bench(cfg, args.model, progress=console.log)
        print_vllm_report(report, Console())
    else:
        report = run_fork_bench(model.executor, model.fingerprint, cfg, progress=console.log)
        print_report(report, Console())
    write_json(args.json, report)


def _workload_allgather(args: argparse.Namespace) -> None:
    from rich.console import Console

    from kmesh.compute.loader import load_model
    from kmesh.engine.engine import Engine
    from kmesh.workloads.allgather import AllGatherConfig, generate_trace, save_trace

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


def _bench_allgather(args: argparse.Namespace) -> None:
    from rich.console import Console

    from kmesh.bench.allgather import run_allgather_bench
    from kmesh.bench.allgather_config import AllGatherBenchConfig
    from kmesh.bench.allgather_report import print_table, write_report
    from kmesh.bench.common import report_console
    from kmesh.compute.loader import load_model
    from kmesh.engine.engine import Engine
    from kmesh.workloads.allgather import AllGatherConfig, generate_trace, load_trace

    options = (
        "policy",
        "master",
        "recompute_ratio",
        "shared_ratio",
        "agent_ratio",
        "check_layer",
        "gate",
        "gate_sample",
    )
    given = {name: getattr(args, name) for name in options if getattr(args, name) is not None}
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
    else:
        workload = AllGatherConfig(
            args.agents or 8, args.rounds or 3, args.order or "shuffle", args.seed
        )
    if args.engine != "vllm" and args.block_size is not None:
        raise InvalidRequestError("--block-size is vLLM's page size: it needs --engine vllm")
    if args.engine == "vllm":
        trace = (trace_model, turns) if args.trace is not None else None
        _bench_allgather_vllm(args, cfg, workload, trace)
        return
    console = Console(stderr=True)
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
        console.log(f"generating the workload: {workload.agents} agents, {workload.rounds} rounds")
        turns = generate_trace(workload, engine, model.tokenizer, progress=console.log)
    others = []
    for agents in scale:
        if agents == workload.agents:
            others.append(turns)
            continue
        console.log(f"generating the workload for --scale: {agents} agents")
        other = replace(workload, agents=agents)
        others.append(generate_trace(other, engine, model.tokenizer, progress=console.log))
    report = run_allgather_bench(
        model.executor,
        model.fingerprint,
        turns,
        cfg,
        workload,
        args.sweep,
        others,
        progress=console.log,
    )
    if args.closed_loop:
        from kmesh.bench.closed_loop import reference_closed_loop

        loops = reference_closed_loop(
            Engine(model.executor, model.fingerprint, kv_cache_tokens=1 << 15),
            model.tokenizer,
            workload,
            cfg,
            progress=console.log,
        )
        for name, loop in loops.items():
            report["strategies"][name]["closed_loop"] = loop
    print_table(report, report_console())
    write_json(args.json, report)
    if args.report is not None:
        print(f"wrote {write_report(report, Path(args.report))}")


def _bench_allgather_vllm(
    args: argparse.Namespace, cfg: Any, workload: Any, trace: tuple[str, Any] | None
) -> None:
    from rich.console import Console

    from kmesh.bench.allgather_report import print_table
    from kmesh.bench.allgather_vllm import run_vllm_allgather_bench
    from kmesh.bench.common import report_console
    from kmesh.compute.loader import resolve_model_dir
    from kmesh.vllm.scheduler_side import model_fingerprint

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
    console = Console(stderr=True)
    report = run_vllm_allgather_bench(
        turns,
        cfg,
        workload,
        args.model,
        args.block_size,
        args.sweep,
        args.closed_loop,
        progress=console.log,
    )
    write_json(args.json, report)
    print_table(report, report_console())


def _bench_restore(args: argparse.Namespace) -> None:
    from rich.console import Console

    from kmesh.bench.common import report_console
    from kmesh.bench.restore import print_restore, run_restore_bench

    try:
        sizes = [int(part) for part in args.tokens.split(",")]
    except ValueError:
        raise InvalidRequestError(
            f"--tokens takes sizes separated by commas, like 1024,4096; got {args.tokens!r}"
        ) from None
    if any(n < 16 for n in sizes) or args.concurrency < 1:
        raise InvalidRequestError("--tokens sizes must be >= 16 and --concurrency >= 1")
    console = Console(stderr=True)
    report = run_restore_bench(args.model, sizes, args.concurrency, progress=console.log)
    print_restore(report, report_console())
    write_json(args.json, report)


def _bench_vllm_family(args: argparse.Namespace) -> None:
    from rich.console import Console

    from kmesh.bench.common import report_console
    from kmesh.bench.vllm_family import FamilyBenchConfig, print_family, run_family_bench

    if args.instances < 1 or args.requests < args.instances or args.trunk_tokens < 1:
        raise InvalidRequestError(
            "--instances must be >= 1, --requests at least --instances, --trunk-tokens >= 1"
        )
    config = FamilyBenchConfig(
        args.instances, args.requests, args.trunk_tokens, args.max_tokens, args.model
    )
    console = Console(stderr=True)
    report = run_family_bench(config, progress=console.log)
    print_family(report, report_console())
    write_json(args.json, report)


def _store_serve(args: argparse.Namespace) -> None:
    from kmesh.state.tenants import load_api_keys
    from kmesh.store.server import parse_size, serve

    capacity = parse_size(args.capacity)
    api_keys = None if args.api_keys is None else load_api_keys(args.api_keys)

    def ready() -> None:
        print(f"kmesh store: listening on {args.socket}, capacity {capacity} bytes", flush=True)

    serve(args.socket, capacity, lease=args.lease, on_ready=ready, api_keys=api_keys)


def agent_counts(text: str | None, flag: str = "--scale", minimum: int = 2) -> list[int]:
    """Agent counts given as "4,8,16" to `flag` (none when the flag is absent)."""
    if text is None:
        return []
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise InvalidRequestError(
            f"{flag} takes agent counts separated by commas, like 4,8,16; got {text!r}"
        ) from None
    if any(n < minimum for n in counts):
        raise InvalidRequestError(f"{flag} agent counts must be at least {minimum}")
    return counts


def write_json(path: str, report: dict[str, object]) -> None:
    """Write a benchmark report, creating its folder."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {target}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kmesh", description="KMesh: keyed inference state shared across related requests."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="complete one prompt with the reference engine")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--tenant-salt", default=None, help="keep this request's state apart")
    gen.add_argument(
        "--store", default=None, help="a `kmesh store serve` socket: restore from it, publish to it"
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    gen.set_defaults(func=_generate)

    model = commands.add_parser("model", help="the model")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    info = model_commands.add_parser("info", help="print the model's config and cache location")
    info.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=_model_info)

    demo = commands.add_parser(
        "demo", help="a generation, then a small All-Gather benchmark (4 agents, 2 rounds)"
    )
    demo.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    demo.set_defaults(func=_demo)

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
    allgather.add_argument(
        "--model", default=None, help="model folder (default: the embedded model)"
    )
    allgather.set_defaults(func=_workload_allgather)

    bench = commands.add_parser("bench", help="benchmarks: print a table, write JSON")
    benches = bench.add_subparsers(dest="bench_command", required=True)
    fork = benches.add_parser(
        "fork",
        help="best-of-N / chain-of-thought / tree search: independent vs prefix cache vs fork",
    )
    fork.add_argument("--mode", choices=["best-of-n", "cot", "tree"], required=True)
    fork.add_argument(
        "--engine",
        choices=["reference", "vllm"],
        default="reference",
        help="vllm: independent requests vs vLLM's n vs kmesh serve's n, on vLLM",
    )
    fork.add_argument("--branches", type=int, default=8, help="branches (tree: width per level)")
    fork.add_argument("--trunk-tokens", type=int, default=1024, help="prompt length")
    fork.add_argument("--branch-tokens", type=int, default=32, help="tokens each branch generates")
    fork.add_argument(
        "--reasoning-tokens",
        type=int,
        default=64,
        help="cot: trunk tokens generated before forking",
    )
    fork.add_argument("--seed", type=int, default=0)
    fork.add_argument("--json", required=True, help="where to write the report")
    fork.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    fork.set_defaults(func=_bench_fork)

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
    gather.add_argument("--check-layer", type=int, default=None, help="kv_deviation's (default 1)")
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
        "all (collective at --agent-ratio 0; default 0.125)",
    )
    gather.add_argument("--no-gate", action="store_true", help="no quality gate")
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
        "with full prefill's (bench/closed_loop.py)",
    )
    gather.add_argument("--json", required=True, help="where to write the report")
    gather.add_argument("--report", default=None, help="folder for report.md and plots")
    gather.add_argument("--model", default=None, help="model folder (default: the embedded model)")
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
    gather.set_defaults(func=_bench_allgather)

    restore = benches.add_parser(
        "restore", help="restore keyed state from a store vs recompute it; singleflight"
    )
    restore.add_argument("--tokens", default="1024,4096,16384", help="prompt sizes")
    restore.add_argument(
        "--concurrency", type=int, default=8, help="engine processes asking for one prompt"
    )
    restore.add_argument("--json", required=True, help="where to write the report")
    restore.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    restore.set_defaults(func=_bench_restore)

    family = benches.add_parser(
        "vllm-family",
        help="one family over several vLLM instances sharing a store vs vanilla vLLM",
    )
    family.add_argument("--instances", type=int, default=2, help="vLLM processes")
    family.add_argument("--requests", type=int, default=8, help="family members, round-robin")
    family.add_argument("--trunk-tokens", type=int, default=2048, help="shared trunk length")
    family.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per request")
    family.add_argument("--json", required=True, help="where to write the report")
    family.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    family.set_defaults(func=_bench_vllm_family)

    cli_lora.add_commands(commands, benches)
    cli_council.add_commands(benches)
    cli_load.add_commands(benches)
    commands.add_parser(
        "vllm", help="vLLM's own command line from this install: kmesh vllm serve|bench serve ..."
    )  # main() hands `kmesh vllm ...` to kmesh.cli_vllm before parsing

    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (completions, chat) until SIGTERM/SIGINT"
    )
    serve.add_argument("--engine", choices=["reference", "vllm"], required=True)
    serve.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0: any free port")
    serve.add_argument(
        "--strict-fields",
        action="store_true",
        help="refuse request fields the server does not know (default: ignore and log them)",
    )
    serve.add_argument(
        "--reuse-messages",
        action="store_true",
        help="approximate: a chat without a kmesh object, under a cache_salt starting with "
        "kmesh-approx, reuses any message another request of that tenant computed",
    )
    serve.add_argument(
        "--reuse-ratio",
        type=float,
        default=None,
        help="with --reuse-messages: share of the reused rows recomputed (default: "
        "per-request recovery's; docs/SERVE.md has the sweep)",
    )
    serve.add_argument(
        "--store", default=None, help="a `kmesh store serve` socket: restore from it, publish to it"
    )
    serve.add_argument(
        "--recovery-bytes",
        default=None,
        metavar="SIZE",
        help="what recovery keeps (stored segments, round masters) at most, like 256M "
        "(default 1G; least recently used dropped first)",
    )
    serve.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help='JSON {"API key": "tenant", ...}: requests need `Authorization: Bearer KEY`, and '
        "state never crosses tenants (default: no keys, one namespace)",
    )
    serve.set_defaults(func=_serve)

    store = commands.add_parser("store", help="the shared state store")
    store_commands = store.add_subparsers(dest="store_command", required=True)
    store_serve = store_commands.add_parser(
        "serve", help="serve keyed state in shared memory on a Unix socket until SIGTERM/SIGINT"
    )
    store_serve.add_argument("--socket", required=True, help="Unix socket path to listen on")
    store_serve.add_argument(
        "--capacity", required=True, help="payload bytes to hold, like 512M, 2G or 1048576"
    )
    store_serve.add_argument(
        "--lease",
        type=float,
        default=60.0,
        help="seconds a leader has to publish or renew before a waiter takes over (default 60)",
    )
    store_serve.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help='JSON {"API key": "tenant", ...}: engines give a key (KMESH_STORE_KEY) and see only '
        "their tenant's entries (default: no keys)",
    )
    store_serve.set_defaults(func=_store_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["vllm"]:  # vLLM's own command line, its arguments untouched
        from kmesh.cli_vllm import run_vllm

        return run_vllm(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except KMeshError as error:
        print(f"kmesh: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
