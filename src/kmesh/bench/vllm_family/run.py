"""`kmesh bench vllm-family`: one declared family over several vLLM instances sharing a store.

R requests share a T-token trunk (real text: the start of argparse's source, the same on every
machine with Python 3.11) and differ in a short suffix; they are spread round-robin over N vLLM
instances (separate processes), which all start sending at the same moment. Two runs, one after
the other in the same instance processes (each starts and shuts down its own engine per run):
- vanilla: N plain vLLM instances with prefix caching: each computes the trunk once;
- kmesh: N instances with KMeshConnector on one `kmesh store serve`: the first to claim the trunk
  computes it, the others wait for it and restore it, so the trunk is computed once in total.
Reported per run: prompt, computed, reused (local prefix cache) and restored tokens summed over
requests, how many trunk computations that amounts to, prefill seconds (the largest first-token
latency: from the go signal until every request has its first token) and wall seconds (until the
last instance's last output, with max_tokens decode steps); greedy outputs of the two runs are
compared.
"""

import inspect
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Column, Table

from kmesh.bench.common import hardware
from kmesh.compute.loader import load_tokenizer, resolve_model_dir
from kmesh.errors import InvalidRequestError, KMeshError
from kmesh.store.process import start_store

SUFFIXES = (
    "# Question: which class parses the command line?",
    "# Summary of this module in one sentence:",
    "class VerboseParser(ArgumentParser):\n    def",
    "# List three public functions defined above:",
    "# What does parse_known_args return?",
    "# Translate the first docstring into French:",
    "# Write a unit test for ArgumentParser.add_argument:",
    "# Which exceptions can the parser raise?",
)
START_TIMEOUT_S = 600


@dataclass(frozen=True, slots=True)
class FamilyBenchConfig:
    instances: int = 2
    requests: int = 8
    trunk_tokens: int = 2048
    max_tokens: int = 16
    model: str | None = None  # None: the embedded model
    store_capacity: str = "1G"

    def __post_init__(self) -> None:
        if self.instances < 1 or self.requests < self.instances or self.trunk_tokens < 1:
            raise InvalidRequestError(
                "--instances must be >= 1, --requests at least --instances, --trunk-tokens >= 1"
            )


def family_prompts(tokenizer: Any, trunk_tokens: int, requests: int) -> list[list[int]]:
    import argparse

    trunk = tokenizer(inspect.getsource(argparse))["input_ids"][:trunk_tokens]
    if len(trunk) < trunk_tokens:
        raise KMeshError(f"the trunk text has only {len(trunk)} tokens, asked {trunk_tokens}")
    return [
        trunk + tokenizer(f"\n\n{SUFFIXES[i % len(SUFFIXES)]} ({i})")["input_ids"]
        for i in range(requests)
    ]


def instance_specs(
    config: FamilyBenchConfig, prompts: list[list[int]], store: str | None, work: Path
) -> list[dict[str, Any]]:
    """Each instance's part of one run (in `work`, a fresh folder): its requests (round-robin),
    its ready file, the run's go file, its result file."""
    work.mkdir()
    model = str(resolve_model_dir(config.model))
    family = {"family": "bench", "branches": 0}
    specs = []
    for i in range(config.instances):
        mine = prompts[i :: config.instances]
        specs.append(
            {
                "model": model,
                "store": store,
                "prompts": mine,
                "max_tokens": config.max_tokens,
                "kmesh": family | {"branches": len(mine)},
                "ready": str(work / f"ready-{i}"),
                "go": str(work / "go"),
                "result": str(work / f"result-{i}.json"),
            }
        )
    return specs


def run_instances(
    config: FamilyBenchConfig,
    runs: dict[str, list[dict[str, Any]]],
    work: Path,
    progress: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    """Start the instances (one process each, in `work`), which take part in `runs` (name ->
    instance_specs) one run after another; release each run's instances together once all of
    them are ready; collect each run's results."""
    processes = []
    for i in range(config.instances):
        path = work / f"spec-{i}.json"
        path.write_text(json.dumps({"runs": [specs[i] for specs in runs.values()]}))
        log = (work / f"instance-{i}.log").open("wb")
        command = [sys.executable, "-m", "kmesh.bench.vllm_family.instance", str(path)]
        processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
    summaries = {}
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for name, specs in runs.items():
            progress(f"{name}: starting {config.instances} instances")
            while not all(Path(s["ready"]).exists() for s in specs):
                _check_alive(processes, work, deadline)
                time.sleep(0.2)
            progress(f"{name}: {config.instances} instances ready; go")
            go = time.time()
            Path(specs[0]["go"]).touch()
            while not all(Path(s["result"]).exists() for s in specs):
                _check_alive(processes, work, deadline)
                time.sleep(0.2)
            instances = [json.loads(Path(s["result"]).read_text()) for s in specs]
            summaries[name] = _summary(config, instances, max(i["ended"] for i in instances) - go)
            deadline = time.monotonic() + START_TIMEOUT_S
        for process in processes:
            process.wait(timeout=START_TIMEOUT_S)
        _check_alive(processes, work, deadline=float("inf"))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    return summaries


def _check_alive(processes: list[subprocess.Popen], work: Path, deadline: float) -> None:
    for i, process in enumerate(processes):
        if (process.poll() or 0) != 0 or time.monotonic() > deadline:
            log = (work / f"instance-{i}.log").read_text(errors="replace")
            raise KMeshError(f"vLLM instance {i} failed or did not start:\n{log[-4000:]}")


def _summary(config: FamilyBenchConfig, instances: list[dict], seconds: float) -> dict[str, Any]:
    requests = [r for inst in instances for r in inst["requests"]]
    totals = {
        k: sum(r[k] for r in requests)
        for k in ("prompt_tokens", "computed_tokens", "reused_tokens", "restored_tokens")
    }
    suffix_tokens = totals["prompt_tokens"] - config.trunk_tokens * len(requests)
    trunk_computed = totals["computed_tokens"] - suffix_tokens
    return {
        **totals,
        "trunk_computations": trunk_computed / config.trunk_tokens,
        "prefill_seconds": max(r["first_token_seconds"] for r in requests),
        "seconds": seconds,
        "instance_seconds": [inst["seconds"] for inst in instances],
        "instances": instances,
    }


def run_family_bench(
    config: FamilyBenchConfig, progress: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    if config.instances < 1 or config.requests < config.instances:
        raise KMeshError("need at least one instance and at least one request per instance")
    tokenizer = load_tokenizer(resolve_model_dir(config.model))
    prompts = family_prompts(tokenizer, config.trunk_tokens, config.requests)
    report: dict[str, Any] = {"config": asdict(config), "hardware": hardware()}
    with tempfile.TemporaryDirectory(prefix="kmesh-family-") as tmp:
        work = Path(tmp)
        store = start_store(work, capacity=config.store_capacity)
        try:
            runs = {
                "vanilla": instance_specs(config, prompts, None, work / "vanilla"),
                "kmesh": instance_specs(config, prompts, store.socket, work / "kmesh"),
            }
            progress(
                f"{config.instances} vLLM instances: vanilla, then KMeshConnector on one store "
                "(about a minute each)"
            )
            report.update(run_instances(config, runs, work, progress))
        finally:
            store.stop()

    def outputs(run: dict) -> list[list[int]]:
        return [r["output_ids"] for inst in run["instances"] for r in inst["requests"]]

    report["outputs_identical"] = outputs(report["vanilla"]) == outputs(report["kmesh"])
    return report


def print_family(report: dict[str, Any], console: Console) -> None:
    c = report["config"]
    table = Table(
        Column("run"),
        Column("prompt tokens", justify="right"),
        Column("computed", justify="right"),
        Column("reused (local)", justify="right"),
        Column("restored (store)", justify="right"),
        Column("trunk computations", justify="right"),
        Column("prefill s", justify="right"),
        Column("wall s", justify="right"),
        title=f"bench vllm-family: {c['requests']} requests, {c['trunk_tokens']}-token trunk, "
        f"{c['instances']} vLLM instances",
    )
    for name in ("vanilla", "kmesh"):
        run = report[name]
        table.add_row(
            name,
            str(run["prompt_tokens"]),
            str(run["computed_tokens"]),
            str(run["reused_tokens"]),
            str(run["restored_tokens"]),
            f"{run['trunk_computations']:.2f}",
            f"{run['prefill_seconds']:.2f}",
            f"{run['seconds']:.2f}",
        )
    console.print(table)
    same = "yes" if report["outputs_identical"] else "NO"
    console.print(f"greedy outputs identical (kmesh vs vanilla): {same}")
