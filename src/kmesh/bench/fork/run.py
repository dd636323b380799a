"""`kmesh bench fork`: one branching workload, three ways to run it.

- independent: every branch is a request that computes its whole context (no sharing at all);
- prefix_cache: the same requests with exact full-block prefix caching, like vLLM's n>1: the first
  request of a group runs one step ahead so the rest hit its blocks, and each recomputes the
  partial last block (and at least its last prompt token);
- fork: the family is declared, the trunk computed once and retained, branches fork it
  copy-on-write and sample their first token from the trunk's held logits.

The workload is controlled: the prompt is `trunk_tokens` seeded random token ids and generation
never stops early (no stop tokens), so every strategy does the same work. Accounting:
computed_prompt_tokens = every token position the engine computed minus the leaves' own generated
tokens (a leaf of B tokens computes B - 1 of them); ideal_prompt_tokens = the context once: the
prompt, the trunk's reasoning (cot) or the tree's node tokens (tree).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from rich.console import Console
from rich.table import Column, Table

from kmesh.bench.common import report_table
from kmesh.compute.executor import Executor
from kmesh.engine.engine import Engine
from kmesh.engine.request import Request, RequestOutput, SamplingParams
from kmesh.errors import InvalidRequestError
from kmesh.kv.block_pool import blocks_for
from kmesh.workloads.branching import best_of_n, chain_of_thought, tree_search, tree_seed

MODES = ("best-of-n", "cot", "tree")
STRATEGIES = ("independent", "prefix_cache", "fork")


@dataclass(frozen=True, slots=True)
class ForkBenchConfig:
    mode: str
    branches: int
    trunk_tokens: int
    branch_tokens: int
    reasoning_tokens: int = 64  # cot only: generated trunk tokens before the fork
    seed: int = 0
    temperature: float = 0.8
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("branches", "trunk_tokens", "branch_tokens"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"--{name.replace('_', '-')} must be at least 1")
        if self.mode == "cot" and self.reasoning_tokens < 1:
            raise InvalidRequestError("--reasoning-tokens must be at least 1 for --mode cot")

    @property
    def num_leaves(self) -> int:
        return self.branches**2 if self.mode == "tree" else self.branches

    def report_fields(self) -> dict[str, Any]:
        """The workload as a report's config lists it (both engines' reports)."""
        return {
            "mode": self.mode,
            "branches": self.branches,
            "leaves": self.num_leaves,
            "trunk_tokens": self.trunk_tokens,
            "branch_tokens": self.branch_tokens,
            "reasoning_tokens": self.reasoning_tokens if self.mode == "cot" else 0,
            "seed": self.seed,
            "temperature": self.temperature,
        }


@dataclass(slots=True)
class StrategyRun:
    name: str
    leaves: list[RequestOutput]
    # Tree nodes (level 1), or the cot trunk; empty for best-of-n.
    inner: list[RequestOutput] = field(default_factory=list)
    computed_tokens: int = 0
    kv_bytes_peak: int = 0
    kv_bytes_per_block: int = 0
    seconds: float = 0.0


def prompt_ids(cfg: ForkBenchConfig, vocab_size: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(cfg.seed)
    return tuple(torch.randint(100, vocab_size, (cfg.trunk_tokens,), generator=gen).tolist())


def _branch_params(cfg: ForkBenchConfig) -> SamplingParams:
    return SamplingParams(
        max_tokens=cfg.branch_tokens, temperature=cfg.temperature, stop_token_ids=()
    )


def _reasoning_params(cfg: ForkBenchConfig) -> SamplingParams:
    return SamplingParams(max_tokens=cfg.reasoning_tokens, stop_token_ids=())


def _leaf_seed(cfg: ForkBenchConfig, i: int) -> int:
    return cfg.seed * 1000 + i


def _run_groups(engine: Engine, groups: list[list[Request]]) -> list[list[RequestOutput]]:
    """Run groups of requests that share a prompt, all together. With prefix caching on, the
    first request of each group runs one step ahead so the others can hit the blocks it computes
    (requests in the same step cannot share)."""
    done: dict[str, RequestOutput] = {}
    rest = [request for group in groups for request in group]
    if engine.kv.prefix_caching:
        firsts = [group[0] for group in groups]
        for request in firsts:
            engine.add_request(request)
        done.update((o.request_id, o) for o in engine.step())
        rest = [request for group in groups for request in group[1:]]
    for request in rest:
        engine.add_request(request)
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step())
    return [[done[request.request_id] for request in group] for group in groups]


def _leaf(request_id: str, prompt: tuple[int, ...], params: SamplingParams, seed: int) -> Request:
    return Request(request_id, prompt, replace(params, seed=seed), keep_logits=True)


def _requests_path(engine: Engine, cfg: ForkBenchConfig, prompt: tuple[int, ...]) -> StrategyRun:
    """independent / prefix_cache: the same work as plain requests, phase by phase."""
    params = _branch_params(cfg)
    if cfg.mode == "tree":
        [nodes] = _run_groups(
            engine,
            [
                [
                    _leaf(f"node-{i}", prompt, params, tree_seed(cfg.seed, i))
                    for i in range(cfg.branches)
                ]
            ],
        )
        groups = [
            [
                _leaf(f"leaf-{i}-{j}", prompt + node.output_ids, params, tree_seed(cfg.seed, i, j))
                for j in range(cfg.branches)
            ]
            for i, node in enumerate(nodes)
        ]
        leaves = [leaf for group in _run_groups(engine, groups) for leaf in group]
        return StrategyRun("", leaves, nodes)
    inner: list[RequestOutput] = []
    context = prompt
    if cfg.mode == "cot":
        inner = engine.generate([Request("trunk", prompt, _reasoning_params(cfg))])
        context = prompt + inner[0].output_ids
    seeds = [_leaf_seed(cfg, i) for i in range(cfg.branches)]
    [leaves] = _run_groups(
        engine, [[_leaf(f"leaf-{i}", context, params, seed) for i, seed in enumerate(seeds)]]
    )
    return StrategyRun("", leaves, inner)


def _fork_path(engine: Engine, cfg: ForkBenchConfig, prompt: tuple[int, ...]) -> StrategyRun:
    params = _branch_params(cfg)
    seeds = [_leaf_seed(cfg, i) for i in range(cfg.branches)]
    if cfg.mode == "best-of-n":
        result = best_of_n(engine, "bench", prompt, seeds, params, keep_logits=True)
        return StrategyRun("", result.branches)
    if cfg.mode == "cot":
        result = chain_of_thought(
            engine, "bench", prompt, _reasoning_params(cfg), seeds, params, keep_logits=True
        )
        return StrategyRun("", result.branches, [result.trunk])
    tree = tree_search(
        engine, "bench", prompt, cfg.branches, params, seed=cfg.seed, keep_logits=True
    )
    return StrategyRun("", [leaf for group in tree.leaves for leaf in group], tree.nodes)


def run_strategy(
    executor: Executor, fingerprint: str, cfg: ForkBenchConfig, strategy: str
) -> StrategyRun:
    prompt = prompt_ids(cfg, executor.config.vocab_size)
    context = cfg.trunk_tokens + cfg.reasoning_tokens + 2 * cfg.branch_tokens
    engine = Engine(
        executor,
        fingerprint,
        block_size=cfg.block_size,
        kv_cache_tokens=min((cfg.num_leaves + cfg.branches + 1) * context, 1 << 16),
        prefix_caching=strategy == "prefix_cache",
    )
    started = time.perf_counter()
    path: Callable[[Engine, ForkBenchConfig, tuple[int, ...]], StrategyRun]
    path = _fork_path if strategy == "fork" else _requests_path
    run = path(engine, cfg, prompt)
    run.seconds = time.perf_counter() - started
    run.name = strategy
    run.computed_tokens = engine.counters.computed_tokens
    run.kv_bytes_per_block = engine.kv_bytes_per_block
    run.kv_bytes_peak = engine.counters.peak_blocks_in_use * run.kv_bytes_per_block
    return run


def ideal_prompt_tokens(cfg: ForkBenchConfig) -> int:
    if cfg.mode == "cot":
        return cfg.trunk_tokens + cfg.reasoning_tokens
    if cfg.mode == "tree":
        return cfg.trunk_tokens + cfg.branches * cfg.branch_tokens
    return cfg.trunk_tokens


def kv_bytes_bound(cfg: ForkBenchConfig, bytes_per_block: int) -> int:
    """What fork may hold at its peak, in whole blocks (paged allocation): the trunk (prompt and
    reasoning), every branch's own tokens, and one block per branch (its copy of the trunk's
    partly filled block). Tree nodes are branches of the root and trunks of their leaves."""
    trunk_tokens = cfg.trunk_tokens + (cfg.reasoning_tokens if cfg.mode == "cot" else 0)
    num_branches = cfg.num_leaves + (cfg.branches if cfg.mode == "tree" else 0)
    per_branch = blocks_for(cfg.branch_tokens, cfg.block_size) + 1
    blocks = blocks_for(trunk_tokens, cfg.block_size) + num_branches * per_branch
    return blocks * bytes_per_block


def _compare(fork: StrategyRun, independent: StrategyRun) -> tuple[float, float]:
    """(max abs logit difference up to each pair's first differing token, fraction of
    branches (and tree nodes) whose prompt and output tokens are identical)."""
    pairs = list(zip(fork.inner + fork.leaves, independent.inner + independent.leaves, strict=True))
    max_diff = 0.0
    identical = 0
    for ours, theirs in pairs:
        same = ours.prompt_ids == theirs.prompt_ids and ours.output_ids == theirs.output_ids
        identical += same
        if ours.logits is None or theirs.logits is None or ours.prompt_ids != theirs.prompt_ids:
            continue
        for step, (a, b) in enumerate(zip(ours.logits, theirs.logits, strict=False)):
            max_diff = max(max_diff, float((a - b).abs().max()))
            if ours.output_ids[step] != theirs.output_ids[step]:
                break
    return max_diff, identical / len(pairs)


def run_fork_bench(
    executor: Executor,
    fingerprint: str,
    cfg: ForkBenchConfig,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    runs = {}
    for strategy in STRATEGIES:
        progress(f"running {strategy}")
        runs[strategy] = run_strategy(executor, fingerprint, cfg, strategy)
    ideal = ideal_prompt_tokens(cfg)
    strategies = {}
    for name, run in runs.items():
        leaf_own = sum(len(leaf.output_ids) - 1 for leaf in run.leaves)
        strategies[name] = {
            "computed_prompt_tokens": run.computed_tokens - leaf_own,
            "ideal_prompt_tokens": ideal,
            "computed_tokens_total": run.computed_tokens,
            "kv_bytes_peak": run.kv_bytes_peak,
            "seconds": round(run.seconds, 3),
        }
    max_diff, identical = _compare(runs["fork"], runs["independent"])
    return {
        "config": {
            **cfg.report_fields(),
            "block_size": cfg.block_size,
            "model": fingerprint,
        },
        "strategies": strategies,
        "max_logit_diff_fork_vs_independent": max_diff,
        "branches_identical": identical,
        "fork_kv_bytes_bound": kv_bytes_bound(cfg, runs["fork"].kv_bytes_per_block),
        "fork_seconds_over_independent": round(
            runs["fork"].seconds / runs["independent"].seconds, 3
        ),
        "ideal_compute_ratio": round(
            strategies["fork"]["computed_tokens_total"]
            / strategies["independent"]["computed_tokens_total"],
            3,
        ),
    }


def strategy_table(
    report: dict[str, Any], title: str, extra: dict[str, Callable[[dict[str, Any]], str]]
) -> Table:
    """A fork report's table: per strategy, computed prompt tokens against the ideal, then the
    `extra` columns (header -> cell of a strategy's row), then seconds. Both engines' reports."""
    cfg = report["config"]
    header: list[str | Column] = [
        Column("strategy", no_wrap=True),
        "computed prompt",
        "ideal",
        "ratio",
        *extra,
        "seconds",
    ]
    rows = [
        [
            name,
            str(row["computed_prompt_tokens"]),
            str(row["ideal_prompt_tokens"]),
            f"{row['computed_prompt_tokens'] / row['ideal_prompt_tokens']:.2f}",
            *(cell(row) for cell in extra.values()),
            f"{row['seconds']:.2f}",
        ]
        for name, row in report["strategies"].items()
    ]
    return report_table(
        header,
        rows,
        f"bench fork {title}--mode {cfg['mode']}: {cfg['leaves']} leaves, trunk "
        f"{cfg['trunk_tokens']} tokens, {cfg['branch_tokens']} tokens per branch",
    )


def print_report(report: dict[str, Any], console: Console) -> None:
    extra = {
        "all computed": lambda row: str(row["computed_tokens_total"]),
        "KV peak MiB": lambda row: f"{row['kv_bytes_peak'] / 2**20:.1f}",
    }
    console.print(strategy_table(report, "", extra))
    console.print(
        f"fork vs independent: branches identical {report['branches_identical']:.2f}, max logit "
        f"diff {report['max_logit_diff_fork_vs_independent']:.2e}, seconds ratio "
        f"{report['fork_seconds_over_independent']:.3f} (compute ratio "
        f"{report['ideal_compute_ratio']:.3f}); fork KV bound "
        f"{report['fork_kv_bytes_bound'] / 2**20:.1f} MiB"
    )
