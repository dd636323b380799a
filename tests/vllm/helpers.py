"""What the worker half's tests hand it in place of vLLM's attention modules."""

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend


def cpu_attention(names: Iterable[str]) -> dict[str, Any]:
    """vLLM's CPU attention modules by layer name, as the worker half reads them: their backend
    (the page format) and the ISA vLLM's cache-write op takes."""
    return {name: SimpleNamespace(attn_backend=CPUAttentionBackend, isa="vec") for name in names}
