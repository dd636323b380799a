"""How `kmesh bench capacity` sizes each vLLM engine within the budget B, one rule for every
vLLM-based strategy: a max_model_len that fits the workload (its longest prompt and that
prompt's answer, in whole pages, not vLLM's default 8192) and a KV cache of at least one such
request, the least vLLM starts with. A budget below that is refused before anything starts.

- vanilla: its KV cache is B;
- vanilla_offload: half of B as KV cache, at least one request's, vLLM's CPU offloading the rest;
- kmesh_vllm, kmesh_vllm_lru: one request's KV cache, KMesh's store the rest.
"""

from dataclasses import dataclass

from kmesh.bench.capacity.accounting import VLLM_PAGE
from kmesh.bench.capacity.config import CapacityConfig
from kmesh.errors import InvalidRequestError

# The embedded model's context (SmolLM2's max_position_embeddings), vLLM's default max_model_len.
MODEL_MAX_LEN = 8192


@dataclass(frozen=True, slots=True)
class EngineSizing:
    """One vLLM engine's share of the budget: kv_cache_bytes + offload_bytes is the budget."""

    max_model_len: int  # tokens: the longest prompt and its answer, in whole pages
    kv_cache_bytes: int  # vLLM's KV cache, at least one request of max_model_len
    offload_bytes: int  # the rest: vLLM's CPU offloading or KMesh's store (vanilla: 0)


def max_model_len(cfg: CapacityConfig) -> int:
    """Room for the longest prompt and its answer, in whole pages, up to the model's 8192:
    a system prompt and persona or task (< 160 tokens), what every earlier round appended (the
    council: every output with its header, < output_tokens + 16 each; a trajectory: a step and
    a tool result with their framing, < output_tokens + tool_tokens + 64), the instruction and
    the answer."""
    if cfg.workload == "trajectory":
        appended = cfg.output_tokens + cfg.tool_tokens + 64
    else:
        appended = max(cfg.agents) * (cfg.output_tokens + 16)
    tokens = 160 + (cfg.rounds - 1) * appended + 64 + cfg.output_tokens
    return min(MODEL_MAX_LEN, -(-tokens // VLLM_PAGE) * VLLM_PAGE)


def request_kv_bytes(cfg: CapacityConfig, per_token: int) -> int:
    """KV bytes of one request of max_model_len: the least KV cache vLLM starts with.
    NOTE: vLLM keeps one page of its KV cache as the null block, hence the page more."""
    return (max_model_len(cfg) + VLLM_PAGE) * per_token


def check_budget(cfg: CapacityConfig, per_token: int) -> None:
    """Refuse, in one line, a budget that holds no more than one request's KV cache (the
    least any strategy computes in), naming the least budget this workload runs with."""
    request = request_kv_bytes(cfg, per_token)
    if cfg.budget_bytes <= request:
        raise InvalidRequestError(
            f"--budget-mib {cfg.budget_mib} does not hold one request's KV at "
            f"{max(cfg.agents)} agents and {cfg.rounds} rounds ({max_model_len(cfg)} tokens, "
            f"{request / 2**20:.1f} MiB with vLLM's null page): this workload needs "
            f"--budget-mib {(request >> 20) + 1} or more; raise it, or lower --agents or --rounds"
        )


def engine_sizing(cfg: CapacityConfig, strategy: str, per_token: int) -> EngineSizing:
    """The max_model_len, KV cache and offloaded bytes of `strategy`'s vLLM engine (module
    docstring)."""
    check_budget(cfg, per_token)
    budget, request = cfg.budget_bytes, request_kv_bytes(cfg, per_token)
    if strategy == "vanilla":
        kv_cache = budget
    elif strategy == "vanilla_offload":
        kv_cache = max(budget // 2, request)
    else:
        kv_cache = request
    return EngineSizing(max_model_len(cfg), kv_cache, budget - kv_cache)
