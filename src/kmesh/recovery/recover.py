"""Recovery: turn reused, re-rotated segment KV into KV good enough for a new context.

A region is the part of a prompt after its exact prefix: reusable tokens (their KV comes from
elsewhere, already turned to the region's positions) and new tokens (always computed). Recovery
recomputes a policy's choice of the reusable tokens together with the new ones, against the exact
prefix and the reused KV of everything not recomputed (the executor's subset primitive):

- policies without a check layer (none, full, first_k, random) compute the chosen tokens through
  all layers;
- kv_deviation (CacheBlend; and first_k+kv_deviation) first computes every region token through
  layers 0..c (the check layer c), scores each reusable token by the relative deviation of its
  fresh keys from the reused ones at layer c, then continues only the chosen and new tokens
  through the later layers. The fresh KV of layers 0..c is kept for every token (it is paid for),
  unless the caller wants the reused KV kept outside the chosen units (a Master-Mirror sibling,
  whose diff must stay sparse);
- query (ProphetKV; and first_k+query) first computes the region's new tokens (and the gate's
  sample, if gated) through layers 0..c, scores each reusable token by the attention the new
  tokens' queries pay its reused key at layer c (recovery/query_scores.py), then computes the
  chosen and new tokens through all layers (the new ones twice through 0..c, both counted). A
  region where no new token follows a reusable one (nothing asks) gets first_k's choice.

The quality gate: with a threshold set, the check layer is computed for every region (also for
policies that do not need it) and a region whose mean relative deviation exceeds the threshold is
recomputed in full: the safe fallback (or, with `recompute_on_gate` off, left to the caller).
When nothing needs every token's deviation (no kv_deviation budget), the gate reads an evenly
spaced `gate_sample` share of the reusable tokens (at least one per region, at most
`GATE_SAMPLE_MAX` below share 1): only those and the new tokens go through layers 0..c, attending
to the prefix and the reused KV of the rest; the other reusable tokens keep their reused KV at
every layer. The mean over the sample estimates the region's mean deviation; its precision
follows the sample's size, not the region's, so the cap keeps the gate's cost flat as regions
grow (docs/design/collective-recovery.md, "The gate"). Which layer checks: recovery/check_layer.py.

Cost is counted in token-layers divided by the number of layers: a token computed through 2 of 30
layers counts 2/30.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kmesh.compute.executor import DenseKV, Executor, SequenceInput, SequenceOutput
from kmesh.recovery.check_layer import check_layer_for
from kmesh.recovery.policies import check_policy, needs_check_layer, needs_queries, select
from kmesh.recovery.query_scores import QueryCapture, asks, reusable_attention

# Most reusable tokens a sampled gate reads per region (docs/design/collective-recovery.md, "The
# gate").
GATE_SAMPLE_MAX = 64


@dataclass(frozen=True, slots=True)
class RecoveryConfig:
    policy: str
    ratio: float  # share of the reusable units to recompute (ignored by none and full)
    check_layer: int | None = None  # None: the model's (check_layer.default_check_layer)
    gate: float | None = None  # mean relative deviation above which a region is recomputed
    seed: int = 0
    # A gated region is recomputed here in full; without, it is left alone (fell_back, k/v not
    # filled) for the caller's own fallback (vLLM's ordinary prefill, kmesh/recovery/requests.py).
    recompute_on_gate: bool = True
    # Share of the reusable tokens the gate checks when the policy needs no deviations (1.0: all;
    # below 1, at most GATE_SAMPLE_MAX).
    gate_sample: float = 1.0

    def __post_init__(self) -> None:
        check_policy(self.policy)
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"the recompute ratio must be in [0, 1], got {self.ratio}")
        if not 0.0 < self.gate_sample <= 1.0:
            raise ValueError(f"the gate's sample share must be in (0, 1], got {self.gate_sample}")
        if self.check_layer is not None and self.check_layer < 1:
            raise ValueError("the check layer must be >= 1 (keys never deviate at layer 0)")


@dataclass(frozen=True, slots=True)
class RegionInput:
    token_ids: torch.Tensor  # [t]
    positions: torch.Tensor  # [t], all after the prefix's
    prefix: DenseKV | None  # exact KV before the region
    reused_k: torch.Tensor  # [layers, t, kv_heads, head_dim] at `positions`; rows not reusable
    reused_v: torch.Tensor  # are ignored
    reusable: torch.Tensor  # [t] bool
    segment: torch.Tensor  # [t] segment index of each token (first_k's unit of "segment")
    # [t] block index of each token: select whole blocks; None selects tokens.
    block: torch.Tensor | None = None
    # Keep the reused KV of tokens that are not recomputed even at the check layers.
    keep_reused_outside_selection: bool = False
    # reused_k and reused_v (two tensors) were made for this call alone: the result is written
    # into them rather than into copies (a region's KV copied is a big fresh allocation).
    scratch: bool = False


@dataclass(frozen=True, slots=True)
class Recovered:
    k: torch.Tensor  # [layers, t, kv_heads, head_dim]
    v: torch.Tensor
    # Final hidden state of the region's last token, if it was computed (logits of what follows).
    last_hidden: torch.Tensor | None
    recomputed: torch.Tensor  # sorted indices of the reusable tokens that were recomputed
    reused: torch.Tensor  # [t] bool: the rows whose KV is the given one, not computed
    computed_tokens: float  # token-layers / layers
    deviation: float | None  # mean relative key deviation at the check layer, if computed
    fell_back: bool


@dataclass(frozen=True, slots=True)
class _Plan:
    """What the first phase decided for one region."""

    chosen: torch.Tensor  # sorted indices of the reusable tokens to recompute
    mean: float | None  # mean relative key deviation at the check layer, if computed
    fell_back: bool  # the gate sent the region back (recomputed in full, or left to the caller)


def recover(
    executor: Executor, regions: Sequence[RegionInput], cfg: RecoveryConfig
) -> list[Recovered]:
    """Recover a batch of regions (one executor batch per phase)."""
    layers = executor.config.num_layers
    check = check_layer_for(cfg.check_layer, executor.config)
    # The check layers are paid only if used: to choose (kv_deviation or query with a budget;
    # query where a new token may ask) or to gate (pointless when everything is recomputed).
    scoring = needs_check_layer(cfg.policy) and cfg.ratio > 0
    querying = needs_queries(cfg.policy) and cfg.ratio > 0
    gating = cfg.gate is not None and cfg.policy != "full"
    checked = [
        ((scoring or gating) and bool(r.reusable.any())) or (querying and asks(r)) for r in regions
    ]
    # Per checked region: the tokens computed through the check layers (sorted).
    sample = 1.0 if scoring else cfg.gate_sample if gating else 0.0
    early_rows = {i: _early_rows(r, sample) for i, r in enumerate(regions) if checked[i]}
    capture = QueryCapture(check, [~regions[i].reusable[rows] for i, rows in early_rows.items()])
    first = _run(
        executor,
        [
            SequenceInput(r.token_ids[rows], r.positions[rows], _context(r, rows), _prefix(r))
            for r, rows in ((regions[i], rows) for i, rows in early_rows.items())
        ],
        range(check + 1),
        on_layer_input=capture if querying else None,
    )
    early: dict[int, SequenceOutput] = dict(zip(early_rows, first, strict=True))
    asked = dict(zip(early_rows, capture.inputs, strict=True)) if querying else {}
    plans: list[_Plan] = []
    for i, region in enumerate(regions):
        mean = None
        deviation = None
        if i in early and (scoring or gating):
            deviation = _deviation(early[i], region, early_rows[i], check)
            mean = float(deviation[region.reusable[early_rows[i]]].mean())
        attention = None
        if i in asked:
            attention = reusable_attention(
                executor, check, asked[i], region, region.reused_k[check]
            )
        fell_back = gating and mean is not None and cfg.gate is not None and mean > cfg.gate
        chosen = _choose(region, cfg, deviation if scoring else None, attention, fell_back)
        plans.append(_Plan(chosen, mean, fell_back))
    # Second phase: chosen + new tokens through the remaining layers, against the prefix and the
    # reused KV of everything else; from the check layer's residual where the first phase
    # computed all of them, else from the start.
    later = range(check + 1, layers)
    inputs: dict[int, SequenceInput] = {}
    residuals: dict[int, torch.Tensor] = {}
    for i, (region, plan) in enumerate(zip(regions, plans, strict=True)):
        if plan.fell_back and not cfg.recompute_on_gate:
            continue
        compute = torch.sort(torch.cat((plan.chosen, torch.nonzero(~region.reusable)[:, 0]))).values
        if len(compute) == 0:
            continue
        inputs[i] = SequenceInput(
            region.token_ids[compute],
            region.positions[compute],
            _context(region, compute),
            _prefix(region),
        )
        if i in early:
            at = torch.searchsorted(early_rows[i], compute)
            if bool((at < len(early_rows[i])).all()) and bool(
                (early_rows[i][at.clamp_max(len(early_rows[i]) - 1)] == compute).all()
            ):
                residuals[i] = early[i].residual[at]
    resumed = [i for i in inputs if i in residuals]
    fresh = [i for i in inputs if i not in residuals]
    outputs = dict(
        zip(
            resumed,
            _run(executor, [inputs[i] for i in resumed], later, [residuals[i] for i in resumed]),
            strict=True,
        )
    )
    outputs.update(zip(fresh, _run(executor, [inputs[i] for i in fresh], None), strict=True))
    return [
        _assemble(region, plan, early.get(i), early_rows.get(i), outputs.get(i), check, layers)
        for i, (region, plan) in enumerate(zip(regions, plans, strict=True))
    ]


def _run(
    executor: Executor,
    batch: list[SequenceInput],
    layers: range | None,
    residual: list[torch.Tensor] | None = None,
    on_layer_input: QueryCapture | None = None,
) -> list[SequenceOutput]:
    return executor.forward(batch, layers, residual, on_layer_input) if batch else []


def _early_rows(region: RegionInput, sample: float) -> torch.Tensor:
    """Sorted region rows computed through the check layers: every new token, and an evenly
    spaced `sample` share of the reusable ones (all of them at 1.0; none at 0.0, for query's
    scores alone; else at least one, at most GATE_SAMPLE_MAX)."""
    if sample >= 1.0:
        return torch.arange(len(region.token_ids), device=region.token_ids.device)
    if sample == 0.0:
        return torch.nonzero(~region.reusable)[:, 0]
    reusable = torch.nonzero(region.reusable)[:, 0]
    count = max(1, min(GATE_SAMPLE_MAX, round(sample * len(reusable))))
    spaced = torch.linspace(0, len(reusable) - 1, count, device=reusable.device)
    picked = reusable[spaced.round().long().unique()]
    return torch.sort(torch.cat((picked, torch.nonzero(~region.reusable)[:, 0]))).values


def _deviation(
    out: SequenceOutput, region: RegionInput, rows: torch.Tensor, check_layer: int
) -> torch.Tensor:
    """[len(rows)] relative L2 deviation of fresh from reused keys at the check layer, over the
    first phase's rows (0 where not reused)."""
    fresh = out.k[check_layer].float()
    reused = region.reused_k[check_layer][rows].float()
    deviation = (fresh - reused).flatten(1).norm(dim=1) / fresh.flatten(1).norm(dim=1).clamp_min(
        1e-6
    )
    return torch.where(region.reusable[rows], deviation, torch.zeros_like(deviation))


def _choose(
    region: RegionInput,
    cfg: RecoveryConfig,
    deviation: torch.Tensor | None,
    attention: torch.Tensor | None,
    fell_back: bool,
) -> torch.Tensor:
    """Sorted indices of the reusable tokens to recompute; `deviation` (kv_deviation's scores: a
    unit scores its tokens' mean) and `attention` (query's: a unit scores its tokens' sum) cover
    every region token, or are None (for query: nothing asked, so first_k's choice)."""
    tokens = torch.nonzero(region.reusable)[:, 0]
    device = tokens.device
    if fell_back or cfg.policy == "full":
        return tokens
    policy = "first_k" if needs_queries(cfg.policy) and attention is None else cfg.policy
    if region.block is None:
        unit_of_token = torch.arange(len(tokens), device=device)
        units = len(tokens)
    else:
        unit_ids, unit_of_token = torch.unique(region.block[tokens], return_inverse=True)
        units = len(unit_ids)
    unit_segment = torch.zeros(units, dtype=torch.int64, device=device).scatter_(
        0, unit_of_token, region.segment[tokens]
    )
    zeros = torch.zeros(units, device=device)
    unit_deviation = unit_attention = None
    if deviation is not None:
        sums = zeros.index_add(0, unit_of_token, deviation[tokens].float())
        counts = zeros.index_add(0, unit_of_token, torch.ones(len(tokens), device=device))
        unit_deviation = sums / counts
    if attention is not None:
        unit_attention = zeros.index_add(0, unit_of_token, attention[tokens])
    units_chosen = select(
        policy, round(cfg.ratio * units), unit_segment, unit_deviation, unit_attention, cfg.seed
    )
    return tokens[torch.isin(unit_of_token, units_chosen)]


def _context(region: RegionInput, compute: torch.Tensor) -> "_RegionContext":
    """The reused KV of every region token not in `compute` (the prefix is `_prefix`)."""
    keep = torch.ones_like(region.reusable)
    keep[compute] = False
    positions = region.positions[keep]
    rows: torch.Tensor | slice = keep
    if bool(keep[: len(positions)].all()):  # the rows computed are the region's last: a view
        rows = slice(0, len(positions))
    return _RegionContext(positions, region.reused_k, region.reused_v, rows)


def _prefix(region: RegionInput) -> DenseKV | None:
    """The region's exact prefix, which every region token sees in full: the executor attends to
    it unmasked and uncopied (its `shared` context)."""
    if region.prefix is None or len(region.prefix.positions) == 0:
        return None
    return region.prefix


@dataclass(frozen=True, slots=True)
class _RegionContext:
    """A ContextKV (compute/executor.py) of a region's reused rows, read per layer when the
    executor reads it: a view where they are the region's first rows."""

    positions: torch.Tensor
    reused_k: torch.Tensor
    reused_v: torch.Tensor
    keep: torch.Tensor | slice  # [t] bool, or the first rows: the region rows in the context

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.reused_k[index, self.keep], self.reused_v[index, self.keep]


def _assemble(
    region: RegionInput,
    plan: _Plan,
    early: SequenceOutput | None,
    early_rows: torch.Tensor | None,
    late: SequenceOutput | None,
    check_layer: int,
    layers: int,
) -> Recovered:
    t = len(region.token_ids)
    compute = torch.sort(torch.cat((plan.chosen, torch.nonzero(~region.reusable)[:, 0]))).values
    k = region.reused_k if region.scratch else region.reused_k.clone()
    v = region.reused_v if region.scratch else region.reused_v.clone()
    cost = 0.0
    if early is not None and early_rows is not None:
        # The first phase's fresh KV of layers 0..c is kept where it was computed (it is paid
        # for), or only for the recomputed tokens when the reused KV must stay elsewhere.
        keep = torch.ones_like(early_rows, dtype=torch.bool)
        if region.keep_reused_outside_selection:
            keep = torch.isin(early_rows, compute)
        for layer in range(check_layer + 1):
            k[layer, early_rows[keep]] = early.k[layer][keep]
            v[layer, early_rows[keep]] = early.v[layer][keep]
        cost += len(early_rows) * (check_layer + 1) / layers
    if late is not None:
        offset = layers - len(late.k)
        for index, (k_layer, v_layer) in enumerate(zip(late.k, late.v, strict=True)):
            k[offset + index, compute] = k_layer
            v[offset + index, compute] = v_layer
        cost += len(compute) * len(late.k) / layers
    computed_last = len(compute) > 0 and int(compute[-1]) == t - 1
    last_hidden = late.hidden[-1] if late is not None and computed_last else None
    reused = region.reusable.clone()
    reused[compute] = False
    return Recovered(k, v, last_hidden, plan.chosen, reused, cost, plan.mean, plan.fell_back)
