"""An engine's context: what was asked for, or the model's own bounded by the KV cache, and a
one-line refusal for a length the model or the cache cannot take (kmesh/compute/context.py),
checked against vLLM's own arithmetic for the page count."""

from dataclasses import replace

import pytest

from kmesh.compute.config import ModelConfig
from kmesh.compute.context import kv_bytes_per_token, resolve_context, vllm_cache_tokens
from kmesh.compute.tiny import SHAPES
from kmesh.engine.engine import reference_context
from kmesh.errors import InvalidRequestError
from kmesh.vllm.config import vllm_context, workload_context

SMOLLM2 = ModelConfig.from_hf(SHAPES["smollm2_135m"])


@pytest.mark.parametrize("positions", [2048, 4096, 32768, 131072])
def test_without_a_length_the_context_is_the_models_or_what_the_cache_holds(positions):
    config = replace(SMOLLM2, max_position=positions)
    got = vllm_context(config)  # 1 GiB of float32 pages: 23,264 tokens of SmolLM2's shape
    cache = vllm_cache_tokens(config, "float32", 32, 1 << 30, 1)
    assert cache == ((1 << 30) // (32 * 30 * 3 * 64 * 2 * 4) - 1) * 32
    if positions <= cache:
        assert (got.tokens, got.bound) == (positions, "model")
    else:
        assert (got.tokens, got.bound) == (cache, "kv cache")
        assert "raise the KV cache" in got.describe()


def test_a_length_asked_for_is_kept_within_both_bounds():
    got = vllm_context(SMOLLM2, max_model_len=3000)
    assert (got.tokens, got.bound) == (3000, "--max-model-len")
    assert "the model's is 8192" in got.describe()
    with pytest.raises(InvalidRequestError, match="longer than the model's context, 8192"):
        vllm_context(SMOLLM2, max_model_len=8193)
    with pytest.raises(InvalidRequestError, match="does not fit the KV cache, which holds 1408"):
        vllm_context(SMOLLM2, max_model_len=4096, kv_cache_bytes=64 << 20)
    with pytest.raises(InvalidRequestError, match="must be 1 or more"):
        vllm_context(SMOLLM2, max_model_len=0)


def test_a_cache_without_one_page_is_refused():
    with pytest.raises(InvalidRequestError, match="holds no whole page"):
        vllm_context(SMOLLM2, kv_cache_bytes=1 << 20)


def test_tensor_parallel_workers_hold_their_share_of_the_kv_heads():
    """Each worker's cache holds its shard: 3 KV heads over 3 workers are one a worker; over 6,
    vLLM replicates one head per worker."""
    one = kv_bytes_per_token(SMOLLM2, "float32")
    assert kv_bytes_per_token(SMOLLM2, "float32", 3) == one // 3
    assert kv_bytes_per_token(SMOLLM2, "float32", 6) == one // 3
    assert vllm_cache_tokens(SMOLLM2, "bfloat16", 32, 1 << 28, 3) > vllm_cache_tokens(
        SMOLLM2, "bfloat16", 32, 1 << 28, 1
    )


def test_the_page_count_is_vllms():
    """vLLM's start check: the pages a request of max_model_len needs, plus its null block, fit
    the cache's whole pages (vllm.v1.core.kv_cache_utils.check_enough_kv_cache_memory)."""
    page = 32 * kv_bytes_per_token(SMOLLM2, "bfloat16")
    for cache_bytes in (page * 10, page * 10 + page - 1, 1 << 28):
        tokens = vllm_cache_tokens(SMOLLM2, "bfloat16", 32, cache_bytes, 1)
        assert -(-tokens // 32) * page + page <= cache_bytes < (tokens // 32 + 2) * page


def test_the_reference_engine_is_bounded_by_its_pool():
    config = replace(SMOLLM2, max_position=32768)
    got = reference_context(config, None)
    assert (got.tokens, got.bound) == (16384, "kv cache")
    assert reference_context(config, None, 16, 40000).tokens == 32768
    with pytest.raises(InvalidRequestError, match="which holds 16384"):
        reference_context(config, 20000)


def test_a_benchs_context_is_what_its_workload_needs_within_the_model():
    assert workload_context(replace(SMOLLM2, max_position=2048), 1000) == 2048
    assert workload_context(SMOLLM2, 1000) == 4096
    assert workload_context(SMOLLM2, 6000) == 6000


def test_resolve_context_names_which_bound_applied():
    assert resolve_context(SMOLLM2, None, 10**6).bound == "model"
    assert resolve_context(SMOLLM2, None, 4096).bound == "kv cache"
    assert resolve_context(SMOLLM2, 100, 4096).bound == "--max-model-len"
