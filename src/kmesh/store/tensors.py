"""Byte copies between torch tensors and store segments (shared memory), with no intermediate.

An engine's block layout is its own (the reference engine's is one [2, layers, block_size,
kv_heads, head_dim] tensor, vLLM's its layers' pages in order); these move the bytes. Imported by
engines only: the store process has no torch.
"""

import warnings
from collections.abc import Iterable, Iterator

import numpy as np
import torch


def segment_tensor(data: memoryview) -> torch.Tensor:
    """A flat uint8 tensor over a read-only segment view (no copy): copy out of it, then drop
    it before the segment is closed."""
    with warnings.catch_warnings():  # read-only shared memory: torch only reads from it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.frombuffer(data, dtype=np.uint8))


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> Iterator[memoryview]:
    """The bytes of `tensors` (each contiguous, on the CPU), one after another, as views of
    their memory (no copy): the chunks `write_segment` writes."""
    for tensor in tensors:
        yield tensor.reshape(-1).view(torch.uint8).cpu().numpy().data
