"""`kmesh bench round`: one All-Gather round's collective recovery against prefilling it, timed on
any device the executor runs on (the CPU, or a GPU).

The round: a trunk every sibling shares (its KV exact, as a prefix cache holds it), then the
round's segments (every sibling's output of the last round) in each sibling's own order (sibling
s reads segment (i + s) mod S i-th), then an ask. Timed per strategy, as the mean of `repeats`
runs after one warm-up:
- prefill: every sibling's region computed after the trunk, in one executor batch: what plain
  prefix caching leaves to compute;
- collective at a policy and ratio: `recover_round`, the round's first sibling computed exactly
  (the master), the others mirrored from it and corrected (kv_deviation: CacheBlend's check layer;
  first_k: EPIC's first blocks; none: the mirrors as they are; full: everything recomputed).

What the table says is cost, not quality: the agents and allgather benches measure what the
approximate states make the model say. Weights are the model's (--model) or random in a real
model's shape (--shape, compute/tiny.py): time does not depend on the weights' values.
"""

import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any, TypeVar

import torch
from rich.console import Console

from kmesh.bench.common import hardware, report_table
from kmesh.bench.round.config import RoundBenchConfig
from kmesh.compute.executor import DenseKV, Executor, SequenceInput
from kmesh.recovery.collective import MASTER_BLOCK, SiblingInput, recover_round
from kmesh.recovery.recover import RecoveryConfig

# (policy, ratio) of each collective strategy timed, after prefill.
COLLECTIVE = (("none", 0.0), ("first_k", 0.15), ("kv_deviation", 0.15), ("full", 1.0))
T = TypeVar("T")


def build_round(
    executor: Executor, cfg: RoundBenchConfig
) -> tuple[list[SiblingInput], list[SequenceInput]]:
    """The round's siblings (for recover_round) and the same regions as a prefill batch, both
    after the trunk's KV (computed here, exactly)."""
    device = executor.device
    generator = torch.Generator().manual_seed(cfg.seed)

    def ids(n: int) -> torch.Tensor:
        vocab = executor.config.vocab_size
        return torch.randint(3, vocab, (n,), generator=generator).to(device)

    trunk_ids = ids(cfg.trunk_tokens)
    positions = torch.arange(cfg.trunk_tokens, device=device)
    trunk = executor.forward([SequenceInput(trunk_ids, positions)])[0]
    prefix = DenseKV(positions, trunk.k, trunk.v)
    segments = [ids(cfg.segment_tokens) for _ in range(cfg.siblings)]
    ask = ids(cfg.ask_tokens)
    siblings = []
    for s in range(cfg.siblings):
        order = [(i + s) % cfg.siblings for i in range(cfg.siblings)]
        spans = [(0, 0)] * cfg.siblings
        for at, segment in enumerate(order):
            lo = cfg.trunk_tokens + at * cfg.segment_tokens
            spans[segment] = (lo, lo + cfg.segment_tokens)
        region = torch.cat([*(segments[i] for i in order), ask])
        siblings.append(SiblingInput(region, cfg.trunk_tokens, prefix, spans))
    batch = [
        SequenceInput(s.token_ids, torch.arange(s.start, s.end, device=device), prefix)
        for s in siblings
    ]
    return siblings, batch


def _timed(executor: Executor, run: Callable[[], T], repeats: int) -> tuple[float, T]:
    """Mean milliseconds of `run` over `repeats` after one warm-up (the device synchronized),
    and its last result."""
    sync = torch.cuda.synchronize if executor.device.type == "cuda" else (lambda: None)
    result = run()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        result = run()
    sync()
    return (time.perf_counter() - start) / repeats * 1000, result


def run_round_bench(
    executor: Executor, model: str, cfg: RoundBenchConfig, log: Callable[[str], None]
) -> dict[str, Any]:
    siblings, batch = build_round(executor, cfg)
    region_tokens = sum(len(s.token_ids) for s in siblings)
    log(f"prefill: {cfg.siblings} regions of {region_tokens // cfg.siblings} tokens")
    prefill_ms, _ = _timed(executor, lambda: executor.forward(batch), cfg.repeats)
    rows: list[dict[str, Any]] = [
        {"strategy": "prefill", "ms": prefill_ms, "computed_tokens": float(region_tokens)}
    ]
    for policy, ratio in COLLECTIVE:
        log(f"collective {policy}@{ratio}")
        recovery = RecoveryConfig(policy, ratio)
        ms, result = _timed(
            executor,
            partial(recover_round, executor, siblings, recovery, MASTER_BLOCK),
            cfg.repeats,
        )
        strategy = f"collective {policy}@{ratio}"
        rows.append({"strategy": strategy, "ms": ms, "computed_tokens": result.computed_tokens})
    for row in rows:
        row["relative_ms"] = row["ms"] / prefill_ms
    dtype = str(executor.dtype).removeprefix("torch.")
    return {
        "hardware": hardware(dtype),
        "device": str(executor.device),
        "dtype": dtype,
        "model": model,
        "config": asdict(cfg),
        "region_tokens": region_tokens,
        "rows": rows,
    }


def print_round(report: dict[str, Any], console: Console) -> None:
    cfg = report["config"]
    title = (
        f"One round of {cfg['siblings']} siblings after a {cfg['trunk_tokens']}-token trunk: "
        f"{report['model']} on {report['device']} ({report['dtype']})"
    )
    rows = [
        (
            row["strategy"],
            f"{row['ms']:.1f}",
            f"{row['relative_ms']:.2f}x",
            f"{row['computed_tokens']:.0f}",
        )
        for row in report["rows"]
    ]
    console.print(report_table(("strategy", "ms", "vs prefill", "computed tokens"), rows, title))
