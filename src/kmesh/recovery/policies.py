"""Which reused tokens to recompute: selection policies behind one interface.

A policy picks `budget` of the reusable units (tokens, or whole blocks) of a region:
- none: nothing (reuse as is);
- full: everything (the budget is ignored);
- kv_deviation: CacheBlend's rule, the units whose keys at an early check layer deviate most
  from the reused keys (needs that layer computed for every reusable token);
- first_k: EPIC's rule, the first units of every reused segment (rank 0 of each segment, then
  rank 1, ...), so each segment gets its first k and the remainder goes to the earliest segments;
- query: ProphetKV's rule, the units the region's new tokens attend to most at the check layer
  (needs those new tokens' queries there: recovery/query_scores.py);
- first_k+kv_deviation, first_k+query: half the budget (rounded up) to first_k's choice, the rest
  to the other rule's ranking among the units first_k did not take;
- random: the same budget spent on random units, the control that shows a rule beats chance.
"""

import torch

POLICIES = (
    "none",
    "full",
    "kv_deviation",
    "first_k",
    "random",
    "query",
    "first_k+kv_deviation",
    "first_k+query",
)
_FIRST_K_AND = "first_k+"


def needs_check_layer(policy: str) -> bool:
    """Whether the policy ranks by every reusable token's key deviation at the check layer."""
    return policy in ("kv_deviation", "first_k+kv_deviation")


def needs_queries(policy: str) -> bool:
    """Whether the policy ranks by the attention of the region's new tokens at the check layer."""
    return policy in ("query", "first_k+query")


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown recovery policy {policy!r}; choose one of {POLICIES}")


def select(
    policy: str,
    budget: int,
    unit_segment: torch.Tensor,
    deviation: torch.Tensor | None = None,
    attention: torch.Tensor | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """Indices (sorted) of the chosen units among len(unit_segment) units; `unit_segment` [u]
    gives each unit's segment (units of a segment in order), `deviation` [u] each unit's
    check-layer deviation (kv_deviation and its combination only), `attention` [u] the attention
    the region's new tokens pay each unit (query and its combination only); a policy raises
    ValueError without the scores it ranks by."""
    check_policy(policy)
    units = len(unit_segment)
    device = unit_segment.device
    budget = max(0, min(budget, units))
    if policy == "full":
        return torch.arange(units, device=device)
    if policy == "none" or budget == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    if policy == "first_k":
        chosen = _first_k(unit_segment, budget)
    elif policy == "random":
        # Drawn on the CPU: the same units on every device.
        generator = torch.Generator().manual_seed(seed)
        chosen = torch.randperm(units, generator=generator)[:budget].to(device)
    elif policy.startswith(_FIRST_K_AND):
        first = _first_k(unit_segment, (budget + 1) // 2)
        taken = torch.zeros(units, dtype=torch.bool, device=device)
        taken[first] = True
        rest = torch.nonzero(~taken)[:, 0]
        scores = _scores(policy.removeprefix(_FIRST_K_AND), units, deviation, attention)[rest]
        chosen = torch.cat((first, rest[torch.topk(scores, budget - len(first)).indices]))
    else:
        chosen = torch.topk(_scores(policy, units, deviation, attention), budget).indices
    return torch.sort(chosen).values


def _scores(
    rule: str, units: int, deviation: torch.Tensor | None, attention: torch.Tensor | None
) -> torch.Tensor:
    """The per-unit scores a ranking rule (kv_deviation or query) orders units by."""
    if rule == "kv_deviation":
        scores, what = deviation, "check-layer deviation"
    else:
        scores, what = attention, "attention score"
    if scores is None or len(scores) != units:
        raise ValueError(f"{rule} needs one {what} per unit")
    return scores


def _first_k(unit_segment: torch.Tensor, budget: int) -> torch.Tensor:
    """first_k's `budget` units: every segment's first unit, then every second, ..."""
    units = len(unit_segment)
    rank = _rank_within_segment(unit_segment)
    # Stable sort by (rank, segment).
    return torch.argsort(rank * units + unit_segment, stable=True)[:budget]


def _rank_within_segment(unit_segment: torch.Tensor) -> torch.Tensor:
    """0 for each segment's first unit, 1 for its second, ... (units of a segment contiguous)."""
    index = torch.arange(len(unit_segment), device=unit_segment.device)
    starts = torch.ones(len(unit_segment), dtype=torch.bool, device=unit_segment.device)
    starts[1:] = unit_segment[1:] != unit_segment[:-1]
    first = torch.cummax(torch.where(starts, index, 0), dim=0).values
    return index - first
