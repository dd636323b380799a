"""Which reused tokens to recompute: selection policies behind one interface.

A policy picks `budget` of the reusable units (tokens, or whole blocks) of a region:
- none: nothing (reuse as is);
- full: everything (the budget is ignored);
- kv_deviation: CacheBlend's rule, the units whose keys at an early check layer deviate most
  from the reused keys (needs that layer computed for every reusable token);
- first_k: EPIC's rule, the first units of every reused segment (rank 0 of each segment, then
  rank 1, ...), so each segment gets its first k and the remainder goes to the earliest segments;
- random: the same budget spent on random units, the control that shows a rule beats chance.
"""

import torch

POLICIES = ("none", "full", "kv_deviation", "first_k", "random")


def needs_check_layer(policy: str) -> bool:
    return policy == "kv_deviation"


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown recovery policy {policy!r}; choose one of {POLICIES}")


def select(
    policy: str,
    budget: int,
    unit_segment: torch.Tensor,
    deviation: torch.Tensor | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """Indices (sorted) of the chosen units among len(unit_segment) units; `unit_segment` [u]
    gives each unit's segment (units of a segment in order), `deviation` [u] each unit's check-layer
    deviation (kv_deviation only)."""
    check_policy(policy)
    units = len(unit_segment)
    device = unit_segment.device
    budget = max(0, min(budget, units))
    if policy == "full":
        return torch.arange(units, device=device)
    if policy == "none" or budget == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    if policy == "kv_deviation":
        if deviation is None or len(deviation) != units:
            raise ValueError("kv_deviation needs one check-layer deviation per unit")
        chosen = torch.topk(deviation, budget).indices
    elif policy == "first_k":
        rank = _rank_within_segment(unit_segment)
        # Stable sort by (rank, segment): every segment's first unit, then every second, ...
        chosen = torch.argsort(rank * units + unit_segment, stable=True)[:budget]
    else:
        # Drawn on the CPU: the same units on every device.
        generator = torch.Generator().manual_seed(seed)
        chosen = torch.randperm(units, generator=generator)[:budget].to(device)
    return torch.sort(chosen).values


def _rank_within_segment(unit_segment: torch.Tensor) -> torch.Tensor:
    """0 for each segment's first unit, 1 for its second, ... (units of a segment contiguous)."""
    index = torch.arange(len(unit_segment), device=unit_segment.device)
    starts = torch.ones(len(unit_segment), dtype=torch.bool, device=unit_segment.device)
    starts[1:] = unit_segment[1:] != unit_segment[:-1]
    first = torch.cummax(torch.where(starts, index, 0), dim=0).values
    return index - first
