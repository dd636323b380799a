"""What every bench shares: the hardware line its JSON report carries, its tables and the console
they print to, nearest-rank quantiles, and the agents axis of its plots."""

import os
import platform
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from rich.console import Console
from rich.table import Column, Table


def hardware(dtype: str = "fp32") -> str:
    """The machine a report was measured on, and the dtype it computed in, as every bench's JSON
    states it."""
    gpu = f"{torch.cuda.get_device_name(0)} GPU" if torch.cuda.is_available() else "no GPU"
    cpu = f"{os.cpu_count()}-core {platform.machine()} CPU"
    return f"{cpu}, {gpu}, torch {torch.__version__}, {dtype}"


def report_console() -> Console:
    """A console for tables on stdout: the terminal's width, or 160 columns when piped (rich
    would otherwise squeeze the tables into 80)."""
    return Console(width=None if sys.stdout.isatty() else 160)


def report_table(
    header: Sequence[str | Column], rows: Iterable[Sequence[str]], title: str
) -> Table:
    """A report's table for the console: the header's columns, a row per sequence of cells (one
    cell per column), the title above."""
    table = Table(*header, title=title)
    for row in rows:
        table.add_row(*row)
    return table


def quantile(values: list[float], q: float) -> float | None:
    """The nearest-rank `q` quantile of `values` (None when empty): p99 of 16 values is the
    largest."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def agents_axis(axes: Any, counts: Iterable[int]) -> None:
    """A plot's x axis of agent counts (matplotlib Axes): log 2, a tick labelled at every count
    run (12 or 24 read as themselves, not between powers of two)."""
    ticks = sorted(set(counts))
    axes.set_xscale("log", base=2)
    axes.set_xticks(ticks, [str(n) for n in ticks])
    axes.minorticks_off()
    axes.set_xlabel("agents")
