"""The capacity bench's vLLM engine sizing (bench/capacity/sizing.py), checked without an engine
against vLLM's own arithmetic: pages of the KV cache, less its null page, hold max_model_len."""

import pytest

from kmesh.bench.capacity.accounting import VLLM_PAGE
from kmesh.bench.capacity.config import CapacityConfig
from kmesh.bench.capacity.sizing import check_budget, engine_sizing, max_model_len
from kmesh.errors import InvalidRequestError

# SmolLM2-135M in float32: 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 4 bytes.
PER_TOKEN = 2 * 30 * 3 * 64 * 4
MIB = 1 << 20


def _vllm_max_len(kv_cache_bytes: int) -> int:
    """The longest request vLLM's KV cache check admits: its whole pages less the null page."""
    return (kv_cache_bytes // (VLLM_PAGE * PER_TOKEN) - 1) * VLLM_PAGE


def _cfg(budget_mib: int, workload: str = "allgather") -> CapacityConfig:
    return CapacityConfig(agents=(4, 8, 16), rounds=3, budget_mib=budget_mib, workload=workload)


def test_the_reference_gives_the_length_vllm_reported_for_half_of_192_mib():
    # vLLM 0.32 refused vanilla_offload at --budget-mib 192 with "estimated maximum model
    # length is 2144" for its 96 MiB KV cache.
    assert _vllm_max_len(96 * MIB) == 2144


def test_max_model_len_fits_the_longest_prompt_and_answer_in_whole_pages():
    # 160 + 2 rounds x 16 agents x (48 + 16) + 64 + 48 = 2320 tokens: 73 pages.
    assert max_model_len(_cfg(192)) == 2336
    # a trajectory's turn appends a step and a tool result: 160 + 2 x 368 + 64 + 48 = 1008.
    assert max_model_len(_cfg(192, "trajectory")) == 1024


def test_vanilla_offload_keeps_one_request_in_vllm_when_half_the_budget_is_too_small():
    cfg = _cfg(192)
    sizing = engine_sizing(cfg, "vanilla_offload", PER_TOKEN)
    assert _vllm_max_len(cfg.budget_bytes // 2) < sizing.max_model_len  # the failure it fixes
    assert _vllm_max_len(sizing.kv_cache_bytes) >= sizing.max_model_len
    assert sizing.offload_bytes > 0
    assert sizing.kv_cache_bytes + sizing.offload_bytes == cfg.budget_bytes


def test_vanilla_offload_splits_a_large_budget_in_halves():
    sizing = engine_sizing(_cfg(512), "vanilla_offload", PER_TOKEN)
    assert sizing.kv_cache_bytes == sizing.offload_bytes == 256 * MIB


def test_every_vllm_strategy_gets_the_same_max_model_len_and_the_whole_budget():
    cfg = _cfg(192)
    sizings = {s: engine_sizing(cfg, s, PER_TOKEN) for s in ("vanilla", "kmesh_vllm")}
    assert sizings["vanilla"].kv_cache_bytes == cfg.budget_bytes
    assert sizings["kmesh_vllm"].kv_cache_bytes == (2336 + VLLM_PAGE) * PER_TOKEN
    for sizing in sizings.values():
        assert sizing.max_model_len == 2336
        assert _vllm_max_len(sizing.kv_cache_bytes) >= sizing.max_model_len
        assert sizing.kv_cache_bytes + sizing.offload_bytes == cfg.budget_bytes


def test_a_budget_below_one_request_is_refused_naming_the_minimum_that_runs():
    # One request: (2336 + 32) x 46,080 bytes = 104.1 MiB, so 105 MiB is the least that runs.
    with pytest.raises(InvalidRequestError, match="needs --budget-mib 105 or more") as refused:
        check_budget(_cfg(104), PER_TOKEN)
    assert "\n" not in str(refused.value)
    check_budget(_cfg(105), PER_TOKEN)
    sizing = engine_sizing(_cfg(105), "vanilla_offload", PER_TOKEN)
    assert _vllm_max_len(sizing.kv_cache_bytes) >= sizing.max_model_len
