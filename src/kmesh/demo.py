"""`make demo`: one generation, then a small All-Gather council prefilled four ways.

4 agents, 2 rounds on the embedded model: the trace is generated, then replayed by full prefill,
exact prefix reuse, per-request recovery and collective recovery (bench/allgather/run.py), with the
default policy. Prints the table and writes report.md with plots.
"""

from pathlib import Path

from kmesh.bench.allgather.config import AllGatherBenchConfig
from kmesh.bench.allgather.report import print_table, write_report
from kmesh.bench.allgather.run import run_allgather_bench
from kmesh.bench.common import report_console
from kmesh.compute.loader import load_model
from kmesh.engine.engine import Engine
from kmesh.engine.llm import LLM
from kmesh.engine.request import SamplingParams
from kmesh.workloads.allgather import AllGatherConfig, generate_trace

REPORT_DIR = Path("kmesh-demo-report")


def run_demo(model: str | None = None, report_dir: Path = REPORT_DIR) -> None:
    console = report_console()
    console.rule("KMesh demo: reference engine on the embedded model")
    loaded = load_model(model)
    llm = LLM(loaded)
    question = "What is the capital of France?"
    answer = llm.generate([question], SamplingParams(max_tokens=16), chat=True)[0]
    console.print(f"[bold]Q:[/] {question}\n[bold]A:[/] {answer.text}")

    workload = AllGatherConfig(agents=4, rounds=2, order="shuffle", seed=0)
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
