"""Which layer recovery's check should read (`kmesh bench signals --check-layers`).

An All-Gather-like prompt: an exact prefix, then a region of segments, each computed alone in its
own context (after the model's BOS, if its tokenizer adds one) at positions 0.., its keys turned
to the region's positions and its KV reused; a short header before each segment and a question
after the last are new tokens (always computed). Full prefill of the same prompt is the truth.

Recovery's first phase (kv_deviation, or the gate) computes every region token through layers
0..c against the exact prefix: that is full prefill of those layers, so a reused row's deviation
at check layer c is ||k_reused - k_full|| / ||k_full|| at layer c (recover.py's `_deviation`).
How wrong a reused row's KV is for what follows is taken as that deviation averaged over every
layer. Per check layer c the bench reports:

- `spearman`: the rank correlation of the reused rows' deviation at c with that average;
- `deviation`: their mean deviation at c (what the gate compares with its threshold);
- `kl`: KL(full || recovered) of the last token's next-token distribution after `recover` with
  kv_deviation, `ratio` and check layer c (its fresh layers 0..c kept, the chosen rows through
  the rest), and `cost`, what that recovery computed (token-layers / layers);
- `kl_chosen_only`: the same rows chosen at c, but only they (and the new tokens) computed,
  through every layer, against the reused KV of the rest: what the choice alone buys;
- `layer1_same_cost`: for c > 1, the ratio at which check layer 1 costs what c did, and the KL
  it gets (a later check layer is paid for in early layers computed for every token).

And once per prompt, for scale: `kl_none` (nothing recomputed), `kl_random` and `kl_oracle`
(`ratio` of the rows, chosen at random or by the all-layer average, computed like
`kl_chosen_only`).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kmesh.bench.quality import next_token_kl
from kmesh.bench.signals.check_layer_prompts import Prompt, make_prompt
from kmesh.compute.executor import DenseKV, Executor, SequenceInput
from kmesh.compute.rope import rerotate_keys
from kmesh.recovery.recover import RecoveryConfig, RegionInput, recover


@dataclass(frozen=True, slots=True)
class _Placed:
    region: RegionInput
    full_k: torch.Tensor  # [layers, region tokens, kv_heads, head_dim]: full prefill's keys
    logits: torch.Tensor  # [vocab]: full prefill's last token


def _place(executor: Executor, prompt: Prompt) -> _Placed:
    """Full prefill of the prompt, and its region with every segment's own KV placed in it."""
    config = executor.config
    tokens = list(prompt.prefix) + [t for part, _ in prompt.parts for t in part]
    p, n = len(prompt.prefix), len(tokens)
    full = executor.forward([SequenceInput(torch.tensor(tokens), torch.arange(n))])[0]
    k_full, v_full = torch.stack(full.k), torch.stack(full.v)
    t = n - p
    shape = (config.num_layers, t, config.num_kv_heads, config.head_dim)
    reused_k = torch.zeros(shape, dtype=executor.dtype)
    reused_v = torch.zeros(shape, dtype=executor.dtype)
    reusable = torch.zeros(t, dtype=torch.bool)
    segment = torch.zeros(t, dtype=torch.int64)
    start = 0
    for index, (part, reused) in enumerate(prompt.parts):
        rows = slice(start, start + len(part))
        segment[rows] = index
        if reused:
            own = list(prompt.own) + list(part)
            alone = executor.forward([SequenceInput(torch.tensor(own), torch.arange(len(own)))])[0]
            k = torch.stack(alone.k)[:, len(prompt.own) :]
            v = torch.stack(alone.v)[:, len(prompt.own) :]
            to = torch.arange(p + start, p + start + len(part))
            reused_k[:, rows] = rerotate_keys(k, to - to[0] + len(prompt.own), to, config)
            reused_v[:, rows] = v
            reusable[rows] = True
        start += len(part)
    prefix = DenseKV(torch.arange(p), list(k_full[:, :p]), list(v_full[:, :p]))
    region = RegionInput(
        torch.tensor(tokens[p:]),
        torch.arange(p, n),
        prefix,
        reused_k,
        reused_v,
        reusable,
        segment,
    )
    return _Placed(region, k_full[:, p:], executor.logits(full.hidden[-1:])[0])


def deviations(reused_k: torch.Tensor, full_k: torch.Tensor) -> torch.Tensor:
    """[layers, rows] relative L2 deviation of reused from full prefill's keys (recover.py's
    `_deviation`, the fresh keys at a check layer being full prefill's)."""
    fresh = full_k.float().flatten(2)
    return (reused_k.float().flatten(2) - fresh).norm(dim=2) / fresh.norm(dim=2).clamp_min(1e-6)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Rank correlation of two [n] vectors (ties broken by order)."""
    ranks = [torch.argsort(torch.argsort(x)).double() for x in (a, b)]
    ranks = [r - r.mean() for r in ranks]
    return float((ranks[0] * ranks[1]).sum() / (ranks[0].norm() * ranks[1].norm()))


def _kl_computing(executor: Executor, placed: _Placed, chosen: torch.Tensor) -> float:
    """KL(full || recovered) when the region rows `chosen` (of the reusable ones) and the new
    ones are computed through every layer and every other row keeps its reused KV."""
    region = placed.region
    compute = torch.sort(torch.cat((chosen, torch.nonzero(~region.reusable)[:, 0]))).values
    keep = torch.ones(len(region.token_ids), dtype=torch.bool)
    keep[compute] = False
    context = DenseKV(
        region.positions[keep], list(region.reused_k[:, keep]), list(region.reused_v[:, keep])
    )
    out = executor.forward(
        [
            SequenceInput(
                region.token_ids[compute], region.positions[compute], context, region.prefix
            )
        ]
    )[0]
    return _kl(placed.logits, executor.logits(out.hidden[-1:])[0])


def _kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    return float(next_token_kl(reference[None], logits[None])[0])


def measure_prompt(
    executor: Executor,
    prompt: Prompt,
    check_layers: Sequence[int],
    ratio: float,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """One prompt's figures (module docstring)."""
    placed = _place(executor, prompt)
    region = placed.region
    rows = torch.nonzero(region.reusable)[:, 0]
    deviation = deviations(region.reused_k[:, rows], placed.full_k[:, rows])  # [layers, rows]
    truth = deviation.mean(dim=0)
    budget = round(ratio * len(rows))
    generator = torch.Generator().manual_seed(seed)
    random_rows = rows[torch.randperm(len(rows), generator=generator)[:budget]]
    result: dict[str, Any] = {
        "tokens": len(prompt.prefix) + len(region.token_ids),
        "prefix": len(prompt.prefix),
        "reused": len(rows),
        "segments": [len(part) for part, reused in prompt.parts if reused],
        "kl_none": _kl_computing(executor, placed, rows[:0]),
        "kl_random": _kl_computing(executor, placed, random_rows),
        "kl_oracle": _kl_computing(executor, placed, rows[torch.topk(truth, budget).indices]),
        "deviation_by_layer": [round(float(d.mean()), 5) for d in deviation],
        "layers": {},
    }
    for layer in check_layers:
        at = deviation[layer]
        cfg = RecoveryConfig("kv_deviation", ratio, check_layer=layer)
        recovered = recover(executor, [region], cfg)[0]
        assert recovered.last_hidden is not None  # the question's last token is new
        kl = _kl(placed.logits, executor.logits(recovered.last_hidden[None])[0])
        result["layers"][str(layer)] = {
            "spearman": round(spearman(at, truth), 4),
            "deviation": round(float(at.mean()), 5),
            "kl": kl,
            "cost": round(recovered.computed_tokens, 2),
            "kl_chosen_only": _kl_computing(executor, placed, rows[torch.topk(at, budget).indices]),
        }
        if layer > 1:
            # Check layer 1 with the ratio that costs what this layer's recovery cost.
            layers = executor.config.num_layers
            t, new = len(region.token_ids), len(region.token_ids) - len(rows)
            chosen = (recovered.computed_tokens - 2 * t / layers) * layers / (layers - 2) - new
            same = min(1.0, max(0.0, chosen / len(rows)))
            cheap = recover(executor, [region], RecoveryConfig("kv_deviation", same, check_layer=1))
            assert cheap[0].last_hidden is not None
            result["layers"][str(layer)]["layer1_same_cost"] = {
                "ratio": round(same, 4),
                "kl": _kl(placed.logits, executor.logits(cheap[0].last_hidden[None])[0]),
            }
        if log is not None:
            row = result["layers"][str(layer)]
            log(
                f"layer {layer}: spearman {row['spearman']:.3f} deviation {row['deviation']:.4f} "
                f"kl {kl:.4f} chosen-only {row['kl_chosen_only']:.4f} cost {row['cost']:.0f}"
            )
    return result


def check_layer_report(
    executor: Executor,
    tokenizer: Any,
    seeds: Sequence[int],
    check_layers: Sequence[int],
    ratio: float = 0.2,
    segments: int = 5,
    lengths: tuple[int, int] = (150, 400),
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every seed's prompt measured at every check layer, and the mean over seeds per layer."""
    config = executor.config
    by_seed = {}
    for seed in seeds:
        if log is not None:
            log(f"seed {seed}")
        prompt = make_prompt(tokenizer, seed, segments, lengths)
        by_seed[str(seed)] = measure_prompt(executor, prompt, check_layers, ratio, seed, log)
    mean: dict[str, dict[str, float]] = {}
    for layer in map(str, check_layers):
        rows = [result["layers"][layer] for result in by_seed.values()]
        keys = ("spearman", "deviation", "kl", "cost", "kl_chosen_only")
        mean[layer] = {key: sum(row[key] for row in rows) / len(rows) for key in keys}
        if "layer1_same_cost" in rows[0]:
            same = [row["layer1_same_cost"]["kl"] for row in rows]
            mean[layer]["layer1_same_cost_kl"] = sum(same) / len(same)
    return {
        "layers": config.num_layers,
        "windows": list(config.windows),
        "ratio": ratio,
        "segments": segments,
        "lengths": list(lengths),
        "seeds": by_seed,
        "mean": mean,
    }


def print_check_layers(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    seeds = list(report["seeds"])
    windows = report["windows"]
    table = Table(
        title=f"check layer: rows chosen at it, ratio {report['ratio']}; values per seed "
        f"{', '.join(seeds)}"
    )
    columns = (
        "layer",
        "window",
        "spearman vs all-layer deviation",
        "mean deviation",
        "KL",
        "KL, chosen rows only",
        "layer 1 at this cost: KL",
        "cost (tokens)",
    )
    for column in columns:
        table.add_column(column)

    def cells(layer: str, pick: Callable[[dict[str, Any]], float | None], form: str) -> str:
        values = [pick(report["seeds"][seed]["layers"][layer]) for seed in seeds]
        return " / ".join("-" if v is None else format(v, form) for v in values)

    for layer in report["mean"]:
        window = windows[int(layer)]
        table.add_row(
            layer,
            "global" if window is None else str(window),
            cells(layer, lambda row: row["spearman"], ".2f"),
            cells(layer, lambda row: row["deviation"], ".3f"),
            cells(layer, lambda row: row["kl"], ".3f"),
            cells(layer, lambda row: row["kl_chosen_only"], ".3f"),
            cells(layer, lambda row: row.get("layer1_same_cost", {}).get("kl"), ".3f"),
            cells(layer, lambda row: row["cost"], ".0f"),
        )
    console.print(table)
    reference = Table(title="for scale: KL with the same share of rows recomputed")
    for column in ("seed", "tokens", "reused", "none", "random", "by all-layer deviation"):
        reference.add_column(column)
    for seed, result in report["seeds"].items():
        reference.add_row(
            seed,
            str(result["tokens"]),
            str(result["reused"]),
            *(f"{result[key]:.3f}" for key in ("kl_none", "kl_random", "kl_oracle")),
        )
    console.print(reference)
