"""A warm heap for vLLM's worker: memory written once at startup and kept by glibc's allocator,
so that recovery's short-lived buffers land on pages the process already holds.

Why: on this VM (and on any host that takes freed guest memory back) the first write to a page
costs about 6 microseconds. Recovery's buffers (regions, prefixes read back from vLLM's pages,
transcript pieces) grow with every round, so each round's recovering step pushed the heap to a
new peak and faulted 66,000-116,000 pages at 16 agents (docs/design/performance.md, "Memory:
the allocator and first-touch pages").

Contract: `warm(nbytes)` allocates `nbytes` from the heap, writes every page, frees it, and
returns how much the process's resident memory grew and stayed (free heap already resident is
reused, not counted). The memory stays in the process only under
ALLOCATOR_ENV (kmesh/vllm/config.py: no mmap, a trim threshold above the reserve); otherwise glibc
unmaps or trims it at once, `warm` returns about 0 and logs what to set. Held memory is resident
for the process's life; later allocations reuse it and the heap grows past it as before.
`default_reserve` sizes it from the KV cache (recovery's buffers hold copies of cached rows),
never more than a quarter of the memory available when the worker starts.
"""

import logging

import psutil
import torch

log = logging.getLogger(__name__)

# Reserve / KV cache bytes: with a 4 GiB cache the worker's heap grew 1.1 GB over three rounds of
# 16 agents (docs/design/performance.md).
RESERVE_PER_KV_BYTE = 0.5
# Most of MemAvailable a reserve may take.
MAX_SHARE_OF_AVAILABLE = 0.25


def default_reserve(kv_cache_bytes: int) -> int:
    """Half the KV cache, at most a quarter of the memory available now."""
    return int(min(kv_cache_bytes * RESERVE_PER_KV_BYTE, _available() * MAX_SHARE_OF_AVAILABLE))


def warm(nbytes: int) -> int:
    """Write `nbytes` of heap once and free it; how much the resident memory grew and stayed."""
    if nbytes <= 0:
        return 0
    before = _resident()
    block = torch.empty(nbytes, dtype=torch.uint8)
    block.fill_(1)  # every page written, on all of torch's threads
    del block
    kept = max(0, _resident() - before)
    if kept < nbytes // 2:
        log.warning(
            "the worker's heap reserve was not kept (%d of %d bytes): start vLLM's processes "
            "with kmesh.vllm.config.ALLOCATOR_ENV (kmesh serve does) or set heap_reserve_bytes 0",
            kept,
            nbytes,
        )
    return kept


def _resident() -> int:
    return int(psutil.Process().memory_info().rss)


def _available() -> int:
    return int(psutil.virtual_memory().available)
