"""What a bench reads of a server's processes (psutil): resident memory and CPU time, of a
process and every process under it.

Names are what Linux shows (`comm`, so vLLM's engine core is `VLLM::EngineCor`); a process
that ends between the listing and the reading is skipped. CPU time is user + system seconds
used so far; a bench reads it before and after a stretch and takes the difference
(`cpu_used`), so start-up is not counted.
"""

import contextlib
from collections.abc import Mapping

import psutil


def _tree(pid: int) -> list[psutil.Process]:
    process = psutil.Process(pid)
    return [process, *process.children(recursive=True)]


def rss_mib(pid: int) -> dict[str, float]:
    """RSS in MiB of the process and each of its children, by "name pid", and their "total"."""
    rss = {}
    for p in _tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess):  # a child that just ended
            rss[f"{p.name()} {p.pid}"] = p.memory_info().rss / 2**20
    return {**rss, "total": sum(rss.values())}


def cpu_seconds(roots: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds used so far by each root (named by its role, like "server" or "store") and
    by each process under it (by "role/name", processes of one name summed)."""
    seconds: dict[str, float] = {}
    for role, pid in roots.items():
        with contextlib.suppress(psutil.NoSuchProcess):  # a server that ended: nothing to read
            root, *children = _tree(pid)
            for process, label in [(root, role), *((c, None) for c in children)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    name = label or f"{role}/{process.name()}"
                    times = process.cpu_times()
                    seconds[name] = seconds.get(name, 0.0) + times.user + times.system
    return seconds


def cpu_used(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds per process between two `cpu_seconds` readings, and their "total"."""
    used = {name: after[name] - before.get(name, 0.0) for name in sorted(after)}
    return {**used, "total": sum(used.values())}
