"""`make demo`: the product first, then the laboratory.

1. Served: the same 4 agents, 2 All-Gather rounds, sent concurrently over the chat API to plain
   `vllm serve` (prefix caching), to `kmesh serve --engine vllm` with the messages declared
   (exact) and with each round declared (collective recovery: approximate). `kmesh bench
   agents` runs them (bench/agents/run.py); one table: makespan, TTFT p99, prompt tokens computed,
   share of messages identical to plain vLLM's.
2. The laboratory: one generation on the reference engine, then a 4-agent, 2-round council's
   trace replayed by full prefill, exact prefix reuse, per-request recovery and collective
   recovery (bench/allgather/run.py); prints the table and writes report.md with plots.
"""

from pathlib import Path
from typing import Any

from rich.console import Console

from kmesh.bench.agents.config import AgentsBenchConfig
from kmesh.bench.agents.run import run_agents_bench
from kmesh.bench.allgather.config import AllGatherBenchConfig
from kmesh.bench.allgather.report import print_table, write_report
from kmesh.bench.allgather.run import run_allgather_bench
from kmesh.bench.common import report_table
from kmesh.compute.loader import load_model
from kmesh.engine.engine import Engine
from kmesh.engine.llm import LLM
from kmesh.engine.request import SamplingParams
from kmesh.errors import DependencyError
from kmesh.extras import VLLM, require
from kmesh.workloads.allgather import AllGatherConfig, generate_trace

AGENTS = 4
ROUNDS = 2
# What each served strategy is, in the table's words.
SERVED = {
    "vllm": "plain vllm serve",
    "kmesh_exact": "kmesh serve, exact",
    "kmesh_collective": "kmesh serve, collective",
}


def run_served(console: Console, model: str | None) -> None:
    """The served comparison (module docstring, 1); one line instead where vLLM is not
    installed."""
    try:
        require(VLLM, "the demo's served comparison")
    except DependencyError as missing:
        console.print(str(missing))
        return
    console.rule(
        f"Served: {AGENTS} agents, {ROUNDS} All-Gather rounds, all of a round's agents at once"
    )
    cfg = AgentsBenchConfig(
        agents=(AGENTS,),
        rounds=ROUNDS,
        strategies=tuple(SERVED),
        kv_cache="1G",
        store_capacity="1G",
        serial_check=False,
        model=model,
    )
    report = run_agents_bench(cfg, console.log)
    console.print(report_table(SERVED_HEADER, _served_rows(report), _served_title(cfg)))
    console.print(
        "exact: the same KV as plain prefill, so the same messages; collective: each round's "
        "messages computed once and placed in every agent (approximate, opt-in)"
    )


SERVED_HEADER = (
    "server",
    "makespan s",
    "/ plain vLLM",
    "TTFT p99 s",
    "prompt tokens computed / sent",
    "messages identical to plain vLLM's",
)


def _served_title(cfg: AgentsBenchConfig) -> str:
    return (
        f"{cfg.max_tokens} greedy tokens per message, vLLM in {cfg.dtype}, KV cache "
        f"{cfg.kv_cache}, the embedded model unless --model"
    )


def _served_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, run in report["strategies"].items():
        f = run["by_agents"][str(AGENTS)]
        identical = sum(f["identical_to_vllm"]) / len(f["identical_to_vllm"])
        same = "(the reference)" if name == "vllm" else f"{identical:.0%}"
        rows.append(
            [
                SERVED[name],
                f"{f['makespan_s']:.1f}",
                f"{f['over_vllm']:.2f}",
                f"{f['ttft_p99_s']:.2f}",
                f"{sum(f['computed_tokens']):.0f} / {sum(f['prompt_tokens']):.0f}",
                same,
            ]
        )
    return rows


def run_lab(console: Console, model: str | None, report_dir: Path) -> None:
    """The laboratory (module docstring, 2)."""
    console.rule("The laboratory: the reference engine on the embedded model")
    loaded = load_model(model)
    llm = LLM(loaded)
    question = "What is the capital of France?"
    answer = llm.generate([question], SamplingParams(max_tokens=16), chat=True)[0]
    console.print(f"[bold]Q:[/] {question}\n[bold]A:[/] {answer.text}")

    workload = AllGatherConfig(agents=AGENTS, rounds=ROUNDS, order="shuffle", seed=0)
    console.rule(
        f"All-Gather: {workload.agents} agents, {workload.rounds} rounds; every agent reads every "
        "output"
    )
    engine = Engine(loaded.executor, loaded.fingerprint)
    turns = generate_trace(workload, engine, loaded.tokenizer, progress=console.log)
    for turn in turns[-workload.agents :]:
        console.print(f"- member {turn.agent + 1}: {turn.output_text[:90]}", style="dim")
    report = run_allgather_bench(
        loaded.executor,
        loaded.fingerprint,
        turns,
        AllGatherBenchConfig(),
        workload,
        progress=console.log,
    )
    print_table(report, console)
    console.print(f"report with plots: {write_report(report, report_dir)}")
