"""`make demo`: a generation, then exact prefix sharing shown on one shared document.

Replaced by the All-Gather benchmark once it exists.
"""

import time

from rich.console import Console
from rich.table import Table

from kmesh.compute.loader import load_model
from kmesh.engine.engine import Engine
from kmesh.engine.llm import LLM
from kmesh.engine.request import Request, SamplingParams
from kmesh.workloads.branching import best_of_n

QUESTIONS = (
    "Summarize the text above in one sentence.",
    "What is the main risk mentioned above?",
    "Who should read the text above?",
    "Give the text above a short title.",
)


def run_demo(model: str | None = None) -> None:
    console = Console()
    console.rule("KMesh demo: reference engine on the embedded model")
    loaded = load_model(model)
    llm = LLM(loaded)
    question = "What is the capital of France?"
    answer = llm.generate([question], SamplingParams(max_tokens=16), chat=True)[0]
    console.print(f"[bold]Q:[/] {question}\n[bold]A:[/] {answer.text}")

    console.rule("A shared document, written by the model")
    document = llm.generate(
        ["Write a detailed project briefing about building a bridge across a river."],
        SamplingParams(max_tokens=320),
        chat=True,
    )[0].text
    console.print(document[:400] + ("..." if len(document) > 400 else ""), style="dim")

    prompts = [tuple(llm.encode(f"{document}\n\n{q}", chat=True)) for q in QUESTIONS]
    params = SamplingParams(max_tokens=24)
    console.rule(f"{len(QUESTIONS)} questions on the same document: first alone, then together")
    started = time.perf_counter()
    shared = [llm.engine.generate([Request("q0", prompts[0], params)])[0]]
    shared += llm.engine.generate(
        [Request(f"q{i}", p, params) for i, p in enumerate(prompts[1:], start=1)]
    )
    shared_seconds = time.perf_counter() - started

    started = time.perf_counter()
    cold = [
        Engine(loaded.executor, loaded.fingerprint).generate([Request(f"c{i}", p, params)])[0]
        for i, p in enumerate(prompts)
    ]
    cold_seconds = time.perf_counter() - started

    table = Table("request", "prompt", "reused", "computed", "same as cold", "answer")
    for q, out, ref in zip(QUESTIONS, shared, cold, strict=True):
        s = out.stats
        table.add_row(
            q[:28],
            str(s.prompt_tokens),
            str(s.reused_tokens),
            str(s.computed_tokens),
            "yes" if out.output_ids == ref.output_ids else "NO",
            llm.decode(out.output_ids)[:50].replace("\n", " "),
        )
    console.print(table)
    computed = sum(o.stats.computed_tokens for o in shared)
    total = sum(o.stats.prompt_tokens for o in shared)
    console.print(
        f"prefix sharing computed {computed} of {total} prompt tokens in {shared_seconds:.1f} s; "
        f"cold engines computed {total} in {cold_seconds:.1f} s"
    )

    console.rule("Best-of-4 on the same document: one trunk, four copy-on-write forks")
    engine = Engine(loaded.executor, loaded.fingerprint)
    sample = SamplingParams(max_tokens=24, temperature=0.8)
    result = best_of_n(engine, "demo", prompts[1], [1, 2, 3, 4], sample)
    for branch in result.branches:
        console.print("- " + llm.decode(branch.output_ids)[:70].replace("\n", " "))
    own = sum(len(b.output_ids) - 1 for b in result.branches)
    console.print(
        f"the {len(prompts[1])}-token prompt was computed once: {engine.counters.computed_tokens} "
        f"positions in all, {own} of them the branches' own tokens; four independent requests "
        f"would compute {4 * len(prompts[1]) + own}"
    )
