"""The JSON report of `kmesh bench agents` from its runs (bench/agents/run.py: what is measured).

strategies.<name>.by_agents.<n>: makespan_s (the rounds' sum) and round_makespan_s,
    ttft_p50_s / ttft_p99_s over every call of the run and per round, per-round token
    counts (prompt, computed, recovered, new to the system), computed / new in the last
    round, round masters built (KMesh), KV cache use at each round's end and peak (share and
    vLLM pages), store bytes, failures, identical_to_vllm per round, serial_check.
    cpu_s per round: CPU seconds of each server process (and the store's) during the round,
    and their total.
    over_vllm: makespan_s / vllm's makespan_s at the same count, in the same pass.
    The tasks workload only: task_items, task_accuracy, task_retention, task_retention_ci and
    task_agreement, the replies' records against the facts and against vllm's replies
    (bench/agents/task_scores.py).
strategies.<name>.max_agents_under_slo: the largest agent count that, with every smaller
    one, held TTFT p99 under the SLO (0: none did).

With several passes (`repeats`), makespan_s, over_vllm, ttft_p50_s, ttft_p99_s and
cpu_s_total are medians over the passes, and `repeats` holds each pass's values of them and of
identical_to_vllm; every other figure is the first pass's.
"""

import json
import statistics
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kmesh.bench.agents.task_scores import task_scores
from kmesh.bench.common import hardware, quantile
from kmesh.compute.config import ModelConfig
from kmesh.compute.loader import resolve_model_dir
from kmesh.store.server import parse_size
from kmesh.vllm.config import DEFAULT_BLOCK_SIZE
from kmesh.workloads.agent_chats import task_facts

if TYPE_CHECKING:
    from kmesh.bench.agents.config import AgentsBenchConfig


Runs = dict[str, dict[int, dict[str, Any]]]  # strategy -> agent count -> its rounds


def agents_report(cfg: "AgentsBenchConfig", repeats: list[Runs]) -> dict[str, Any]:
    """The report of one or more passes (the first pass's figures; medians over passes)."""
    pages = _kv_pages(cfg)
    first = repeats[0]
    strategies: dict[str, Any] = {}
    for name, by_agents in first.items():
        figures = {}
        for n, run in sorted(by_agents.items()):
            passes = [
                _figures(runs[name][n], runs["vllm"][n], pages, with_texts=False)
                for runs in repeats[1:]
            ]
            figures[str(n)] = _medians(_figures(run, first["vllm"][n], pages), passes)
            if cfg.workload == "tasks":
                texts = [[r["texts"] for r in x["rounds"]] for x in (run, first["vllm"][n])]
                figures[str(n)] |= task_scores(task_facts(cfg.chats(n)), *texts)
        strategies[name] = {
            "by_agents": figures,
            "max_agents_under_slo": _max_under_slo(figures, cfg.slo_ttft_s),
        }
    return {
        "config": {**asdict(cfg), "kv_pages": pages, "hardware": hardware(cfg.computed_in)},
        "strategies": strategies,
    }


MEDIANS = ("makespan_s", "over_vllm", "ttft_p50_s", "ttft_p99_s", "cpu_s_total")


def _medians(first: dict[str, Any], others: list[dict[str, Any]]) -> dict[str, Any]:
    """`first` with MEDIANS taken over it and `others`, each pass's values under `repeats`."""
    passes = [first, *others]
    repeats = {key: [p[key] for p in passes] for key in (*MEDIANS, "identical_to_vllm")}
    medians = {key: statistics.median(values) for key, values in repeats.items() if key in MEDIANS}
    return {**first, **medians, "repeats": repeats}


def _figures(
    run: dict[str, Any], vllm: dict[str, Any], pages: int | None, with_texts: bool = True
) -> dict[str, Any]:
    rounds = run["rounds"]
    ttfts = [t for r in rounds for t in r["ttft_s"]]
    counters = [r["counters"] for r in rounds]
    computed = [c["computed"] for c in counters]
    new = [r["new_tokens"] for r in rounds]
    figures: dict[str, Any] = {
        "makespan_s": _makespan(run),
        "over_vllm": _makespan(run) / _makespan(vllm),
        "round_makespan_s": [r["makespan_s"] for r in rounds],
        "ttft_p50_s": quantile(ttfts, 0.5),
        "ttft_p99_s": quantile(ttfts, 0.99),
        "round_ttft_p99_s": [quantile(r["ttft_s"], 0.99) for r in rounds],
        "prompt_tokens": [c["prompt"] for c in counters],
        "computed_tokens": computed,
        "recovered_tokens": [c.get("recovered", 0.0) for c in counters],
        "new_tokens": new,
        "last_round_computed_over_new": computed[-1] / new[-1] if new[-1] else None,
        "masters_built": [c.get("masters") for c in counters],
        "fallbacks": [c.get("fallbacks") for c in counters],
        "kv_usage_end": [r["kv_usage_end"] for r in rounds],
        "kv_usage_peak": [r["kv_usage_peak"] for r in rounds],
        "kv_pages_end": [_pages(r["kv_usage_end"], pages) for r in rounds],
        "kv_pages_peak": [_pages(r["kv_usage_peak"], pages) for r in rounds],
        "store_bytes": [r["store_bytes"] for r in rounds],
        "cpu_s": [r["cpu_s"] for r in rounds],
        "cpu_s_total": sum(r["cpu_s"]["total"] for r in rounds),
        "failures": [f for r in rounds for f in r["failures"]],
        "identical_to_vllm": [
            _identical(ours["texts"], theirs["texts"])
            for ours, theirs in zip(rounds, vllm["rounds"], strict=True)
        ],
    }
    if with_texts:
        figures["texts"] = [r["texts"] for r in rounds]
    if "serial_check" in run:
        figures["serial_check"] = run["serial_check"]
    return figures


def _makespan(run: dict[str, Any]) -> float:
    return sum(r["makespan_s"] for r in run["rounds"])


def _identical(ours: dict[str, str], theirs: dict[str, str]) -> float:
    return sum(ours[agent] == text for agent, text in theirs.items()) / len(theirs)


def _max_under_slo(figures: dict[str, dict[str, Any]], slo: float) -> int:
    held = 0
    for n, figure in sorted(figures.items(), key=lambda item: int(item[0])):
        if figure["failures"] or figure["ttft_p99_s"] is None or figure["ttft_p99_s"] > slo:
            break
        held = int(n)
    return held


def _kv_pages(cfg: "AgentsBenchConfig") -> int | None:
    """vLLM's KV cache in pages (in the bench's dtype, kmesh.vllm.config's page size); None on
    the reference engine."""
    if cfg.engine != "vllm":
        return None
    model = ModelConfig.from_hf(
        json.loads((resolve_model_dir(cfg.model) / "config.json").read_text())
    )
    per_token = model.kv_bytes_per_token(cfg.dtype)
    return parse_size(cfg.kv_cache) // (per_token * DEFAULT_BLOCK_SIZE)


def _pages(share: float, pages: int | None) -> int | None:
    return None if pages is None else round(share * pages)
