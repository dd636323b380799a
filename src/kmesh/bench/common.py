"""What every bench shares: the hardware line its JSON report carries, the console its tables
print to, and nearest-rank quantiles."""

import os
import platform
import sys

import torch
from rich.console import Console


def hardware() -> str:
    """The machine a report was measured on, as every bench's JSON states it."""
    return (
        f"{os.cpu_count()}-core {platform.machine()} CPU, no GPU, torch {torch.__version__}, fp32"
    )


def report_console() -> Console:
    """A console for tables on stdout: the terminal's width, or 160 columns when piped (rich
    would otherwise squeeze the tables into 80)."""
    return Console(width=None if sys.stdout.isatty() else 160)


def quantile(values: list[float], q: float) -> float | None:
    """The nearest-rank `q` quantile of `values` (None when empty): p99 of 16 values is the
    largest."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
