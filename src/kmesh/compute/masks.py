"""Which keys each new token of an executor batch sees (kmesh/compute/executor.py): masks by
position, and the shared contexts that sequences attend together.

A mask is boolean [n, keys] (True = may attend) over the keys in the order the executor puts them;
None where attention is plain causality over the new tokens (the kernel's own causal path).
"""

from collections.abc import Sequence
from typing import Protocol

import torch


class Keys(Protocol):
    """KV by position (the executor's ContextKV, as far as masks read it)."""

    @property
    def positions(self) -> torch.Tensor: ...


class SequenceInput(Protocol):
    """One sequence of a batch (the executor's SequenceInput, as far as masks read it)."""

    @property
    def positions(self) -> torch.Tensor: ...

    @property
    def context(self) -> Keys | None: ...

    @property
    def shared(self) -> Keys | None: ...


def context_precedes(item: SequenceInput) -> bool:
    """Whether the item has a context and every one of its keys precedes every new token."""
    context = item.context
    return (
        context is not None
        and len(context.positions) > 0
        and bool(context.positions.max() < item.positions.min())
    )


def causal_mask(item: SequenceInput, context_apart: bool = False) -> torch.Tensor | None:
    """[n, m + n]: new token i may attend to a context or new key at a position <= its own
    ([n, n] over the new tokens alone where the context is attended apart); None where that is
    plain causality (no context, positions increasing)."""
    key_positions = item.positions
    if item.context is not None and len(item.context.positions) > 0 and not context_apart:
        key_positions = torch.cat((item.context.positions, item.positions))
    elif bool((item.positions[1:] > item.positions[:-1]).all()):
        return None
    return key_positions[None, :] <= item.positions[:, None]


def window_mask(item: SequenceInput, window: int) -> torch.Tensor:
    """[n, keys]: new token i at p may attend to a shared, context or new key at a position in
    p - window + 1 .. p (keys in the order the executor puts them: shared, context, new)."""
    parts = [c.positions for c in (item.shared, item.context) if c is not None]
    key_positions = torch.cat([*parts, item.positions])
    distance = item.positions[:, None] - key_positions[None, :]
    return (distance >= 0) & (distance < window)


def shared_groups(batch: Sequence[SequenceInput]) -> list[tuple[Keys, list[int]]]:
    """Inputs grouped by the shared context object they hold (checked to precede them)."""
    groups: dict[int, tuple[Keys, list[int]]] = {}
    for index, item in enumerate(batch):
        if item.shared is None:
            continue
        if len(item.shared.positions) and item.shared.positions.max() >= item.positions.min():
            raise ValueError("a shared context must precede every new token of its inputs")
        groups.setdefault(id(item.shared), (item.shared, []))[1].append(index)
    return list(groups.values())
